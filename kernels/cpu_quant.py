"""y = x W^T + b with W in GGUF's quantised blocks (Q8_0, Q4_0, Q4_1; kernels/quant_formats.py), on the CPU
(csrc/quant_gemv.c).

A decode-sized product dequantises each block in registers inside the matrix-vector loop, so it streams the file's
bytes (4.5-8.5 bits per weight) instead of fp32's 32. A prefill-sized one widens ``DEQUANT_ROWS`` weight rows at a
time to fp32 and hands them to torch's sgemm: there the arithmetic, not the weight bytes, sets the time, and the
fp32 slice is a few MiB whatever the matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from genserve.kernels._cpu_library import library, threads
from genserve.kernels.quant_formats import quant_format, row_bytes

GEMV_MAX_ROWS = 16  # up to here the in-register kernel; beyond, dequantised slices and sgemm (bench/quant.py)
DEQUANT_ROWS = 2048  # weight rows widened per sgemm: (2048, K) fp32, 4.5 MiB at K = 576


def supports(x: torch.Tensor, blocks: torch.Tensor) -> bool:
    """True for CPU tensors, fp32/bf16 activations, contiguous uint8 blocks, when the kernels built here."""
    return (x.device.type == "cpu" and blocks.device.type == "cpu" and blocks.dtype == torch.uint8
            and x.dtype in (torch.float32, torch.bfloat16) and blocks.is_contiguous() and library() is not None)


def _check(x: torch.Tensor, blocks: torch.Tensor, qtype: str | int, bias: torch.Tensor | None):
    fmt, k, n = quant_format(qtype), x.shape[-1], blocks.shape[0]
    if blocks.dim() != 2 or blocks.shape[1] != row_bytes(fmt, k) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"quant linear: x (..., {k}), {fmt.name} blocks {tuple(blocks.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit y = x W^T + b")
    lib = library()
    if lib is None:
        raise RuntimeError("quant linear: the CPU kernels could not be built on this machine")
    return fmt, lib


def dequantize(blocks: torch.Tensor, qtype: str | int, in_features: int, rows: slice | None = None) -> torch.Tensor:
    """The fp32 weights (rows, in_features) of ``blocks[rows]`` (default all), widened by the C kernel."""
    fmt = quant_format(qtype)
    start, stop, _ = (rows or slice(None)).indices(blocks.shape[0])
    out = torch.empty(max(stop - start, 0), in_features)
    if out.shape[0] and library().quant_dequant_rows(blocks.data_ptr(), out.data_ptr(), start, out.shape[0],
                                                     in_features, fmt.ggml_type, threads()):
        raise ValueError(f"quant dequantize: {fmt.name} blocks {tuple(blocks.shape)} do not hold {in_features} inputs")
    return out


def linear(x: torch.Tensor, blocks: torch.Tensor, qtype: str | int, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x (..., K), blocks uint8 (N, K / 32 * block bytes), bias (N,) -> (..., N) in x's dtype. Forward only; check
    ``supports`` first."""
    fmt, lib = _check(x, blocks, qtype, bias)
    k, n = x.shape[-1], blocks.shape[0]
    xf = x.reshape(-1, k).to(torch.float32).contiguous()  # (M, K)
    bf = None if bias is None else bias.to(torch.float32).contiguous()
    if xf.shape[0] > GEMV_MAX_ROWS:
        y = torch.empty(xf.shape[0], n)  # (M, N)
        for j in range(0, n, DEQUANT_ROWS):
            rows = slice(j, min(j + DEQUANT_ROWS, n))
            y[:, rows] = F.linear(xf, dequantize(blocks, fmt.ggml_type, k, rows), None if bf is None else bf[rows])
    else:
        y = torch.empty(xf.shape[0], n)
        if xf.shape[0] and lib.quant_gemv(xf.data_ptr(), blocks.data_ptr(), None if bf is None else bf.data_ptr(),
                                          y.data_ptr(), xf.shape[0], n, k, fmt.ggml_type, threads()):
            raise ValueError(f"quant linear: {fmt.name} is not a type the kernel reads")
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
