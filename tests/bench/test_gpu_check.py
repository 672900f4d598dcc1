"""`make gpu-check` cannot rot: the GPU check machine's exact command (bench/gpu_device.sh) runs here with `--dry`,
every section on the CPU at tiny sizes, and prints the full table; what Python 3.12 (that machine's) can check
without torch for 3.12 on this machine is checked too (issue 37)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check import GPU_TEST_FILES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_device_command_dry_run_prints_every_row(tmp_path: Path) -> None:
    env = os.environ | {"GENSERVE_PYTHON": sys.executable, "GENSERVE_SITE": str(tmp_path / "site")}
    done = subprocess.run(["bash", "bench/gpu_device.sh", "--dry"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    header = next(line for line in done.stdout.splitlines() if line.startswith("gpu-check "))
    assert f"Python {sys.version.split()[0]}" in header and "Triton " in header
    table = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    checks = [line.split(" | ")[0].lstrip("| ") for line in table]
    assert checks[0] == "GPU-only tests (pytest -m gpu)"
    # the GPU tests were collected from their files and skipped under the interpreter, none failed
    assert "0 passed, 0 failed" in table[0] and "0 skipped" not in table[0]
    assert any(c.startswith("flash attention") for c in checks)
    assert any(c.startswith("paged decode") for c in checks)
    assert any(c.startswith("sampler") for c in checks)
    assert sum(c.startswith("text engine") for c in checks) == 2
    greedy = next(line for line in table if line.startswith("| greedy tokens vs HF"))
    assert greedy.split(" | ")[3] == "100%"  # fp32 on the CPU: every engine token is HF's argmax
    assert any(c.startswith("diffusion") for c in checks)
    assert not any("FAILED" in line for line in table)
    ratios = [line.split(" | ")[3] for line in table[1:]]
    assert all(r.endswith(("x", "%")) and float(r.rstrip("x%")) > 0 for r in ratios)


def test_the_gpu_test_files_hold_gpu_tests() -> None:
    for path in GPU_TEST_FILES:
        assert "pytest.mark.gpu" in (ROOT / path).read_text(), path


def test_gpu_check_refuses_to_run_without_a_gpu_unless_dry() -> None:
    if __import__("torch").cuda.is_available():
        pytest.skip("a GPU is here")
    done = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "--dry" in done.stdout


def _python312() -> str | None:
    pyenv = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3")))
    candidates = [shutil.which("python3.12"), *pyenv]
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "--version"], capture_output=True).returncode == 0:
            return candidate
    return None


PY312_CHECK = """
import compileall, re, sys, tempfile
from pathlib import Path
sys.path.append(".")
from bench.checkout import link_checkout
ok = all(compileall.compile_dir(d, quiet=1, force=True, legacy=False, optimize=0)
         for d in ("protos/genserve", "kernels", "shared", "services", "bench", "tests"))
link_checkout(Path(tempfile.mkdtemp()))
from genserve.services.text.config import from_hf
from genserve.services.text.engine.params import SamplingParams
from genserve.services.diffusion import params
cfg = from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1})
print(ok, sys.version_info[:2], cfg.head_dim, SamplingParams(max_tokens=3, temperature=0).greedy, bool(params.__name__))
"""


def test_the_package_compiles_and_its_torch_free_code_runs_from_the_checkout_on_python_3_12(tmp_path: Path) -> None:
    """No torch for CPython 3.12 without CUDA can be installed here, so what needs torch, Triton or the wheels runs
    under this venv's Python in the dry run above; Python 3.12 byte-compiles every source and runs the torch-free
    modules through the same checkout link as the device run."""
    python = _python312()
    if python is None:
        pytest.skip("no Python 3.12 on this machine: the 3.12 syntax and stdlib checks did not run")
    env = os.environ | {"PYTHONPYCACHEPREFIX": str(tmp_path)}  # the 3.12 bytecode stays out of the checkout
    done = subprocess.run([python, "-P", "-c", PY312_CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "(3,", "12)", "4", "True", "True"], done.stdout
