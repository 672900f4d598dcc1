"""The production path: a wheel of this checkout, installed without it (`pip install --no-deps --target`), used from a
directory outside the checkout. The wheel holds one top-level package, `genserve`. The C kernels must build from the
wheel's own sources, a text generation must run through them, and a diffusion image must come out of the VAE; both
must equal what the checkout computes. In the same process, Hugging Face's `kernels` distribution (a dev dependency,
and required by transformers 5.25+) is the `kernels` that Python imports, and transformers loads a model through it:
genserve's kernels/ folder shadows nothing, installed or run from the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

# Runs in the installed copy; prints one JSON line.
SCRIPT = textwrap.dedent("""
    import json
    import tempfile

    import kernels as hf_kernels
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import genserve.kernels
    import genserve.services
    from genserve.kernels import _cpu_library
    from genserve.services.common.images import to_png
    from genserve.services.diffusion.pipeline import DiffusionPipeline
    from genserve.services.text.engine.async_engine import AsyncLLMEngine
    from genserve.services.text.engine.params import SamplingParams
    from genserve.services.vae.model import load_vae

    torch.set_num_threads(2)
    status = _cpu_library.status()
    engine = AsyncLLMEngine.from_dir(None).engine
    fused_calls = 0
    if engine.runner.fused is not None:
        step = engine.runner.fused.kernel
        for name in ("run", "greedy"):
            def counted(*args, _original=getattr(step, name), **kwargs):
                global fused_calls
                fused_calls += 1
                return _original(*args, **kwargs)

            setattr(step, name, counted)
    prompt = engine.tokenizer.encode("a red circle")
    text, token_ids, _ = engine.generate_batch([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]

    pipeline = DiffusionPipeline.from_dir(None)
    latents = pipeline.generate(["a large red circle at the center"], steps=4, seed=3)
    with torch.inference_mode():
        images = load_vae(None).decode(latents)
    png = to_png(images[0])

    # transformers' model loading imports Hugging Face's `kernels` (transformers.integrations.hub_kernels).
    hf_config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    hf_dir = tempfile.mkdtemp()
    LlamaForCausalLM(hf_config).save_pretrained(hf_dir)
    hf_model = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    with torch.inference_mode():
        hf_logit = float(hf_model(torch.tensor([[1, 2, 3]])).logits[0, -1, 0])
    print(json.dumps({
        "kernels": genserve.kernels.__file__, "services": genserve.services.__file__, "status": status.reason,
        "available": status.available, "runner": engine.runner.name, "fused": engine.runner.fused is not None,
        "fused_calls": fused_calls, "token_ids": token_ids, "png": png.hex(),
        "image_std": float(images.std()), "hf_kernels": hf_kernels.__file__, "hf_logit": hf_logit,
    }))
""")


def _run(python_path: Path | None, cwd: Path, cache: Path | None = None) -> dict:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("GENSERVE_CPU_KERNELS", None)
    if cache is not None:
        env["GENSERVE_CACHE_DIR"] = str(cache)
    if python_path is not None:
        env["PYTHONPATH"] = str(python_path)
    # -P: the working directory (the checkout's root, for the reference run) is not put first on sys.path.
    done = subprocess.run([sys.executable, "-P", "-c", SCRIPT], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wheels = tmp_path_factory.mktemp("wheels")
    # From a copy of the tracked files: setuptools builds in-tree, and a stale build/ would leak old files.
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    source = tmp_path_factory.mktemp("source")
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(source)],
                   check=True, capture_output=True, timeout=600)
    (built,) = wheels.glob("genserve-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    return target


def test_the_wheel_holds_one_top_level_package_genserve(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"genserve"}
    for package in ("genserve/kernels", "genserve/shared/blocks", "genserve/services/text/engine", "genserve/v1"):
        assert f"{package}/__init__.py" in names, package
    # Every tracked module of the mapped folders is in the wheel, under its genserve name.
    folders = {"kernels": "genserve/kernels", "shared": "genserve/shared", "services": "genserve/services",
               "protos/genserve": "genserve"}
    tracked = subprocess.run(["git", "ls-files", "--", *[f"{folder}/*.py" for folder in folders]], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert len(tracked) > 100
    for path in tracked:
        folder = next(f for f in folders if path.startswith(f + "/"))
        assert folders[folder] + path[len(folder):] in names, path


def test_the_wheel_ships_the_kernel_sources_and_the_weights(installed: Path) -> None:
    shipped = {p.name for p in (installed / "genserve" / "kernels" / "csrc").iterdir()}
    assert shipped == {p.name for p in (ROOT / "kernels" / "csrc").iterdir() if p.suffix in (".c", ".h")}
    for service in ("text", "gan", "vae", "diffusion"):
        assert list((installed / "genserve" / "services" / service / "weights").glob("*.safetensors")), service


def test_the_wheel_ships_the_playground(installed: Path) -> None:
    """Every file of the browser playground (services/http/playground/) is package data: the page needs no checkout."""
    shipped = {p.name for p in (installed / "genserve" / "services" / "http" / "playground").iterdir()}
    assert shipped == {p.name for p in (ROOT / "services" / "http" / "playground").iterdir()}
    assert "index.html" in shipped and "app.js" in shipped


def test_installed_package_generates_text_on_c_kernels_and_decodes_a_diffusion_image(
    installed: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # A fresh kernel cache: the installed copy must compile its own shipped sources, not reuse the checkout's build.
    got = _run(installed, outside, tmp_path / "cache-installed")
    assert got["kernels"].startswith(str(installed)) and got["services"].startswith(str(installed))
    assert got["available"], got["status"]
    assert got["status"] == "built"
    assert got["runner"] == "cpu" and got["fused"]
    assert got["fused_calls"] > 0, "the decode steps did not run on the fused C kernel"
    assert list((tmp_path / "cache-installed").glob("cpu-kernels-*.so"))

    reference = _run(None, ROOT)
    assert reference["services"].startswith(str(ROOT))
    for run in (got, reference):
        assert "site-packages" in run["hf_kernels"] and not run["hf_kernels"].startswith((str(ROOT / "kernels"),
                                                                                           str(installed)))
    assert got["hf_logit"] == reference["hf_logit"]
    assert got["token_ids"] == reference["token_ids"] and len(got["token_ids"]) > 0
    image = bytes.fromhex(got["png"])
    assert image[:8] == b"\x89PNG\r\n\x1a\n"
    assert image == bytes.fromhex(reference["png"])
    assert got["image_std"] > 0.05  # a picture, not a flat fill
