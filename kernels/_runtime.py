"""What every launch wrapper needs to know about how its kernel will run: interpreted on CPU or compiled on a GPU."""

from __future__ import annotations

import functools
import os

import torch

# An SM count for the interpreter: small, so tests exercise the split paths without launching many programs.
_INTERPRETER_SM_COUNT = 4


def interpreting() -> bool:
    """True when TRITON_INTERPRET is set: kernels then run program by program in numpy on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def upcast_for_interpreter(dtype: torch.dtype) -> bool:
    """The interpreter multiplies bf16 bit patterns as integers in tl.dot; fp32 operands give the right answer."""
    return interpreting() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get full-precision products (tf32 would lose ~3 digits); 16-bit inputs use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill: the device's on a GPU, a small fixed number in the interpreter."""
    if device.type != "cuda":
        return _INTERPRETER_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def autotune_limit(configs: list) -> list:
    """The first GENSERVE_AUTOTUNE_CONFIGS autotune candidates (all when unset): each candidate is one Triton compile
    per specialisation, and a cold cache on a GPU check machine cannot afford them all for correctness runs."""
    limit = int(os.environ.get("GENSERVE_AUTOTUNE_CONFIGS", "0"))
    return configs[:limit] if limit > 0 else configs
