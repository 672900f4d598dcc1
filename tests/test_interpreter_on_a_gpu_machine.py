"""`make test` on a machine with a GPU: the tests that force the Triton backend on CPU tensors still run, under the
interpreter, and the GPU-only tests wait for a compiled-kernel run (tests/conftest.py).

The GPU is faked in a child pytest: a plugin, loaded before any conftest, makes torch report a CUDA device and
/dev/nvidia0 exist, with CUDA_VISIBLE_DEVICES set, as on the GPU machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE_GPU = """
    import os

    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    _exists = os.path.exists
    os.path.exists = lambda path: path == "/dev/nvidia0" or _exists(path)


    def pytest_report_header(config):
        return f"fake GPU: torch.cuda.is_available() = {torch.cuda.is_available()}"
"""


def test_interpreter_forced_tests_pass_with_a_gpu_present(tmp_path: Path) -> None:
    (tmp_path / "fake_gpu.py").write_text(textwrap.dedent(FAKE_GPU))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": "0"}
    done = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-p", "fake_gpu", "-p", "no:cacheprovider", "-rs",
         "tests/blocks/test_backend.py", "tests/services/text/test_text_runners.py",
         "-k", "sliding_window_attention_agrees or autograd_on_cuda or (greedy_tokens_with_paged_decode and llama)"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout
    assert "fake GPU: torch.cuda.is_available() = True" in out, out[-3000:]
    assert done.returncode == 0, out[-3000:] + done.stderr[-2000:]
    counts = {name: int(n) for n, name in re.findall(r"(\d+) (passed|failed|skipped)", out.splitlines()[-1])}
    # 4 sliding-window cases (2 of them on the Triton kernels, CPU tensors) + the Llama greedy run on the kernels
    assert counts.get("passed") == 5 and "failed" not in counts, out[-3000:]
    # the one GPU-only test selected is skipped with the command that runs it, not run on a GPU that is not there
    assert counts.get("skipped") == 1 and "TRITON_INTERPRET=0 pytest -m gpu" in out, out[-3000:]
