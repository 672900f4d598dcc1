"""The C kernels of csrc/ for the CPU, compiled once per machine and loaded with ctypes.

A CPU decode step is a few matrix-vector products plus a long tail of small ops, and both sides lose to
per-call overheads and to MKL's generic code paths on non-Intel CPUs; these kernels close that gap (bench/lm.py).
They are built with the system C compiler (``$CC``, default ``cc``) on first use into ``$GENSERVE_CACHE_DIR``
(default ``~/.cache/genserve``), keyed by the sources, the flags, the compiler and the CPU (``-march=native``), and
linked against the OpenMP runtime torch has already loaded. Where no compiler works, ``library()`` is None and
every caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # part of the cache key, not of the command line
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
_PTR, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    # x, w, bias, y, m, n, k, threads
    "gemv_f32": [_PTR] * 4 + [_I64] * 3 + [_INT],
    "gemv_bf16": [_PTR] * 4 + [_I64] * 3 + [_INT],
    # q, k_cache, v_cache, tables, lens, out, batch, hq, hkv, d, block_size, max_blocks, scale, threads
    "paged_decode_f32": [_PTR] * 6 + [_I64] * 6 + [_F32, _INT],
    "paged_decode_bf16": [_PTR] * 6 + [_I64] * 6 + [_F32, _INT],
    # layer weights, n_layers, step inputs, k_caches, v_caches, x, norm, eps, head, vocab, logits, threads
    "decode_step_f32": [_PTR, _I64] + [_PTR] * 5 + [_F32, _PTR, _I64, _PTR, _INT],
    # the same, then n_steps and the (M, n_steps) int64 tokens before threads
    "decode_steps_f32": [_PTR, _I64] + [_PTR] * 5 + [_F32, _PTR, _I64, _PTR, _I64, _PTR, _INT],
    # x, gamma, beta, y, b, c, hw, groups, eps, channels_last, silu
    "group_norm_f32": [_PTR] * 4 + [_I64] * 4 + [_F32] + [_INT] * 2,
    # block weights, block inputs, the address of a BLAS sgemm_
    "spatial_transformer_f32": [_PTR] * 3,
    # block weights, block inputs -> the scratch floats spatial_transformer_f32 needs
    "spatial_transformer_work_f32": [_PTR] * 2,
}
_SIZE_RETURNING = {"spatial_transformer_work_f32"}  # return an int64 size instead of a 0 / error status


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's feature flags (a cached build must not run on another CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build() -> Path:
    compiler = os.environ.get("CC", "cc")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    parts = [*(p.read_text() for p in (*_SOURCES, *_HEADERS)), *_FLAGS, version, _cpu_signature()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("GENSERVE_CACHE_DIR") or Path.home() / ".cache" / "genserve")
    target = cache / f"cpu-kernels-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            subprocess.run([compiler, *_FLAGS, *map(str, _SOURCES), "-o", tmp, "-lm"], capture_output=True,
                           text=True, check=True)
            os.replace(tmp, target)  # atomic: replicas building at once never load a half-written file
        finally:
            Path(tmp).unlink(missing_ok=True)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels (each returns 0 on success, except the size queries), or None where they cannot be built
    here."""
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError) as err:
        log.warning("CPU kernels unavailable, torch ops are used instead: %s", getattr(err, "stderr", "") or err)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, _I64 if name in _SIZE_RETURNING else ctypes.c_int
    return lib


def threads() -> int:
    """Threads per kernel call: torch's intra-op setting, so both share one OpenMP pool of that size."""
    import torch

    return torch.get_num_threads()
