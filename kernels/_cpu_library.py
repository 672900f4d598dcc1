"""The C kernels of csrc/ for the CPU, compiled once per machine and loaded with ctypes.

A CPU decode step is a few matrix-vector products plus a long tail of small ops, and both sides lose to
per-call overheads and to MKL's generic code paths on non-Intel CPUs; these kernels close that gap (bench/lm.py).
They are built with the system C compiler (``$CC``, default ``cc``) on first use into ``$GENSERVE_CACHE_DIR``
(default ``~/.cache/genserve``), keyed by the sources, the flags, the compiler and the CPU, and linked against the
OpenMP runtime torch has already loaded. One process builds at a time (a file lock next to the library), within
``$GENSERVE_CPU_KERNELS_BUILD_TIMEOUT`` seconds (default 300).

``-march`` is ``$GENSERVE_CPU_MARCH`` (default ``native``, which also puts the CPU's feature flags in the key); an
image built for many machines sets a portable level such as ``x86-64-v3`` and builds once at image build time
(``python -m genserve.kernels.build``). ``GENSERVE_CPU_KERNELS=off`` turns the kernels off. Whenever they are
unavailable (off, no compiler, a failed or incomplete build, sources missing from an install), ``library()`` is None,
one log line says why (``status()`` too), and every caller keeps its torch path: never an AttributeError later.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # part of the cache key, not of the command line
_BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300.0
_PTR, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    # x, w, bias, y, m, n, k, threads
    "gemv_f32": [_PTR] * 4 + [_I64] * 3 + [_INT],
    "gemv_bf16": [_PTR] * 4 + [_I64] * 3 + [_INT],
    # x, GGUF blocks, bias, y, m, n, k, GGML type id, threads
    "quant_gemv": [_PTR] * 4 + [_I64] * 3 + [_INT] * 2,
    # GGUF blocks, out, first row, rows, k, GGML type id, threads
    "quant_dequant_rows": [_PTR] * 2 + [_I64] * 3 + [_INT] * 2,
    # q, k_cache, v_cache, tables, lens, out, batch, hq, hkv, d, block_size, max_blocks, scale, threads
    "paged_decode_f32": [_PTR] * 6 + [_I64] * 6 + [_F32, _INT],
    "paged_decode_bf16": [_PTR] * 6 + [_I64] * 6 + [_F32, _INT],
    # layer weights, n_layers, step inputs, k_caches, v_caches, x, norm, eps, head, head type, head row scales,
    # vocab, logits, threads
    "decode_step_f32": [_PTR, _I64] + [_PTR] * 5 + [_F32, _PTR, _INT, _PTR, _I64, _PTR, _INT],
    # the same, then n_steps and the (M, n_steps) int64 tokens before threads
    "decode_steps_f32": [_PTR, _I64] + [_PTR] * 5 + [_F32, _PTR, _INT, _PTR, _I64, _PTR, _I64, _PTR, _INT],
    # q, k, v, o, batch, heads, kv heads, tq, tk, d, the (B, H, T) strides of q, k, v and o, scale, threads
    "attention_f32": [_PTR] * 4 + [_I64] * 6 + [_PTR] * 4 + [_F32, _INT],
    # x, gamma, beta, y, b, c, hw, groups, eps, channels_last, silu
    "group_norm_f32": [_PTR] * 4 + [_I64] * 4 + [_F32] + [_INT] * 2,
    # block weights, block inputs, the address of a BLAS sgemm_
    "spatial_transformer_f32": [_PTR] * 3,
    # block weights, block inputs -> the scratch floats spatial_transformer_f32 needs
    "spatial_transformer_work_f32": [_PTR] * 2,
}
_SIZE_RETURNING = {"spatial_transformer_work_f32"}  # return an int64 size instead of a 0 / error status


@dataclass(frozen=True)
class BuildStatus:
    available: bool
    reason: str  # "built", "disabled", "no compiler", "no sources", "build failed: ...", "incomplete: ..."


def _march() -> str:
    return os.environ.get("GENSERVE_CPU_MARCH") or "native"


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's feature flags (a cached build must not run on another CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compiler() -> str | None:
    """The C compiler that would build the kernels, when one is installed."""
    return shutil.which(os.environ.get("CC", "cc"))


def cache_dir() -> Path:
    return Path(os.environ.get("GENSERVE_CACHE_DIR") or Path.home() / ".cache" / "genserve")


def _build(cc: str) -> Path:
    flags = (*_BASE_FLAGS, f"-march={_march()}")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    cpu = _cpu_signature() if _march() == "native" else ""
    parts = [*(p.read_text() for p in (*_SOURCES, *_HEADERS)), *flags, version, cpu]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    cache = cache_dir()
    target = cache / f"cpu-kernels-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    timeout = float(os.environ.get("GENSERVE_CPU_KERNELS_BUILD_TIMEOUT") or BUILD_TIMEOUT_S)
    with open(cache / f"cpu-kernels-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # replicas starting together: one compiles, the others wait and reuse it
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            subprocess.run([cc, *flags, *map(str, _SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
                           check=True, timeout=timeout)
            os.replace(tmp, target)  # atomic: a reader never loads a half-written file
        finally:
            Path(tmp).unlink(missing_ok=True)
    return target


def _load() -> tuple[ctypes.CDLL | None, BuildStatus]:
    if os.environ.get("GENSERVE_CPU_KERNELS", "").lower() in ("off", "0", "false", "no"):
        return None, BuildStatus(False, "disabled (GENSERVE_CPU_KERNELS=off)")
    if not _SOURCES:
        return None, BuildStatus(False, f"no sources in {Path(__file__).parent / 'csrc'}")
    cc = compiler()
    if cc is None:
        return None, BuildStatus(False, f"no C compiler ({os.environ.get('CC', 'cc')})")
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except subprocess.CalledProcessError as err:
        first = (err.stderr or "").strip().splitlines()[:1]
        return None, BuildStatus(False, f"build failed: {first[0] if first else err}")
    except (OSError, subprocess.SubprocessError) as err:
        return None, BuildStatus(False, f"build failed: {err}")
    missing = [name for name in _SIGNATURES if not hasattr(lib, name)]
    if missing:
        return None, BuildStatus(False, f"incomplete build, missing {', '.join(missing)}")
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, _I64 if name in _SIZE_RETURNING else ctypes.c_int
    return lib, BuildStatus(True, "built")


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, BuildStatus]:
    lib, status = _load()
    if not status.available:
        log.warning("genserve CPU kernels unavailable (%s); torch ops are used instead", status.reason)
    return lib, status


def library() -> ctypes.CDLL | None:
    """The loaded kernels (each returns 0 on success, except the size queries), or None where they cannot be used
    here (``status()`` says why)."""
    return _loaded()[0]


def status() -> BuildStatus:
    """Whether the kernels are in use, and why not."""
    return _loaded()[1]


def threads() -> int:
    """Threads per kernel call: torch's intra-op setting, so both share one OpenMP pool of that size."""
    import torch

    return torch.get_num_threads()
