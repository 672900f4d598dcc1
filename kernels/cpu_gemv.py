"""y = x W^T + b for the few rows of a CPU decode step (csrc/gemv.c).

A decode step multiplies a handful of rows by every weight matrix once, so it is bound by memory bandwidth; MKL's
sgemv reaches about a third of this machine's copy bandwidth on such shapes, the kernel about 90% (bench/lm.py).
Weights are fp32 or bf16; the products are computed in fp32.
"""

from __future__ import annotations

import torch

from genserve.kernels._cpu_library import library, threads

MAX_ROWS = 8  # csrc/gemv.c's limit; beyond it a blocked GEMM (F.linear) reuses each weight across rows


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``gemv(x, weight)`` applies: CPU tensors, 1..MAX_ROWS rows, fp32/bf16, contiguous weight, and
    the kernels built on this machine."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and 0 < x.numel() <= MAX_ROWS * x.shape[-1]
            and weight.dtype in (torch.float32, torch.bfloat16) and x.dtype in (torch.float32, torch.bfloat16)
            and weight.is_contiguous() and library() is not None)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) with 1..MAX_ROWS rows, weight (N, K), bias (N,) -> (..., N) in x's dtype. Forward only;
    check ``supports`` first."""
    k, n = x.shape[-1], weight.shape[0]
    if weight.shape != (n, k) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"gemv: x (..., {k}), weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit y = x W^T + b")
    lib = library()
    if lib is None:
        raise RuntimeError("gemv: the CPU kernels could not be built on this machine")
    xf = x.reshape(-1, k).to(torch.float32).contiguous()  # (M, K)
    bf = None if bias is None else bias.to(torch.float32).contiguous()
    y = torch.empty(xf.shape[0], n, dtype=torch.float32)  # (M, N)
    fn = lib.gemv_f32 if weight.dtype == torch.float32 else lib.gemv_bf16
    if fn(xf.data_ptr(), weight.data_ptr(), None if bf is None else bf.data_ptr(), y.data_ptr(), xf.shape[0], n, k,
          threads()):
        raise ValueError(f"gemv: x has {xf.shape[0]} rows; the kernel takes 1..{MAX_ROWS}")
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
