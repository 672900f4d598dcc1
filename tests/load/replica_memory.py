"""Memory one replica of each service needs, measured on the CPU as a proxy for GPU memory (docs/deploy.md).

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.load.replica_memory

Each service runs in a fresh process that loads its model exactly as its Ray Serve deployment does (the committed
demo weights, or the checkpoint directory in GENSERVE_<SERVICE>_MODEL, as the replicas resolve it), then serves
its largest request (the request limits of services/*/app.py) twice. Reported per service:
- weights: bytes of parameters and buffers (exact); for text also the paged KV cache the engine preallocates;
- resident after load: the process's RSS growth from loading (weights + caches + allocator slack);
- peak per request: the high-water RSS above the loaded state during the second request (activations and
  workspace; the first request warms up kernels and lazy state), read from VmHWM after returning freed heap to
  the kernel (malloc_trim) and resetting the mark through /proc/self/clear_refs.
On a GPU each replica adds a CUDA context (a few hundred MiB, not measured here) to weights + peak.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

MIB = 2**20
SERVICES = ("text", "gan", "vae", "diffusion")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    """Hand freed heap pages back to the kernel (glibc keeps them), then restart the RSS high-water mark."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def _module_bytes(module: torch.nn.Module) -> int:
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def _model_dir(service: str) -> str | None:
    from genserve.services.common.builder import resolve_model_dir

    return resolve_model_dir(service, None)


def _text() -> tuple[int, int, Callable[[], None]]:
    from genserve.services.text.engine.async_engine import AsyncLLMEngine
    from genserve.services.text.engine.params import SamplingParams

    engine = AsyncLLMEngine.from_dir(_model_dir("text")).engine
    cache = sum(t.numel() * t.element_size() for t in (*engine.runner.k_caches, *engine.runner.v_caches))
    prompts = [list(range(1, 129))] * 8  # 8 sequences x 128 prompt tokens: prefill fills max_batched_tokens

    def request() -> None:
        engine.generate_batch(prompts, SamplingParams(max_tokens=32, temperature=1.0, seed=0))

    return _module_bytes(engine.model), cache, request


def _gan() -> tuple[int, int, Callable[[], None]]:
    from genserve.services.gan.app import MAX_IMAGES
    from genserve.services.gan.model import load_generator
    from genserve.services.gan.sampling import generate

    generator = load_generator(_model_dir("gan"))
    z = torch.randn(MAX_IMAGES, generator.config.z_dim)

    def request() -> None:
        with torch.inference_mode():
            generate(generator, z)

    return _module_bytes(generator), 0, request


def _vae() -> tuple[int, int, Callable[[], None]]:
    from genserve.services.vae.app import MAX_IMAGES
    from genserve.services.vae.model import load_vae

    vae = load_vae(_model_dir("vae"))
    x = torch.rand(MAX_IMAGES, 3, vae.config.image_size, vae.config.image_size) * 2 - 1

    def request() -> None:  # Reconstruct: encode then decode the largest batch
        with torch.inference_mode():
            mean, _ = vae.encode(x)
            vae.decode(mean)

    return _module_bytes(vae), 0, request


def _diffusion() -> tuple[int, int, Callable[[], None]]:
    from genserve.services.diffusion.pipeline import DiffusionPipeline
    from genserve.services.diffusion.schema import MAX_IMAGES

    pipe = DiffusionPipeline.from_dir(_model_dir("diffusion"))

    def request() -> None:  # guidance doubles the U-Net batch; the per-step peak does not depend on the step count
        pipe.generate(["a large red circle"] * MAX_IMAGES, steps=2, guidance_scale=3.0, seed=0)

    modules = [m for m in vars(pipe.model).values() if isinstance(m, torch.nn.Module)]
    return sum(_module_bytes(m) for m in modules), 0, request


LOADERS = {"text": _text, "gan": _gan, "vae": _vae, "diffusion": _diffusion}


def measure(service: str) -> dict[str, float]:
    """Runs in the process that measures: load, warm up, reset the high-water mark, serve the largest request."""
    torch.set_num_threads(1)
    importlib.import_module(f"genserve.services.{service}.app")  # what a replica imports before it loads its model
    before = _status_kib("VmRSS")
    weights, cache, request = LOADERS[service]()
    loaded = _status_kib("VmRSS")
    request()
    _reset_peak()
    settled = _status_kib("VmRSS")
    request()
    peak = _status_kib("VmHWM")
    return {
        "weights_mib": weights / MIB,
        "kv_cache_mib": cache / MIB,
        "resident_after_load_mib": (loaded - before) / 1024,
        "peak_per_request_mib": max(0, peak - settled) / 1024,
    }


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(measure(sys.argv[2])))
        return 0
    print(f"{'service':10} {'weights':>10} {'KV cache':>10} {'resident':>10} {'peak/req':>10}   (MiB)")
    for service in SERVICES:
        out = subprocess.run([sys.executable, "-m", "tests.load.replica_memory", "--one", service],
                             capture_output=True, text=True, check=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        print(f"{service:10} {row['weights_mib']:10.1f} {row['kv_cache_mib']:10.1f} "
              f"{row['resident_after_load_mib']:10.1f} {row['peak_per_request_mib']:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
