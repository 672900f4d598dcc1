"""Bidirectional attention for small head sizes on the CPU (csrc/attention.c): the attention of a diffusion
transformer's blocks, where torch's CPU SDPA spends most of its time on per-score overheads (docs/benchmarks.md)."""

from __future__ import annotations

import math

import torch

from genserve.kernels._cpu_library import library, threads

# Head sizes the kernel takes: multiples of 8 up to 32, where it beats SDPA (at 64 SDPA's blocked GEMMs win;
# docs/benchmarks.md, "CPU attention for small heads").
HEAD_SIZES = range(8, 33, 8)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True for fp32 CPU tensors (B, H, T, D) with a contiguous last dimension, D in HEAD_SIZES, H a multiple of the
    KV heads, without autograd, when the kernels built here."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32 and q.dim() == 4
            and k.shape == v.shape and q.shape[-1] == k.shape[-1] in HEAD_SIZES and q.shape[0] == k.shape[0]
            and q.shape[1] % k.shape[1] == 0 and all(t.stride(-1) == 1 for t in (q, k, v))
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
            and library() is not None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * sm_scale) v, no mask: q (B, H, Tq, D), k and v (B, Hkv, Tk, D) -> (B, H, Tq, D), stored as
    (B, Tq, H, D) (the layout the output projection reads). Check ``supports`` first."""
    batch, heads, tq, d = q.shape
    kv_heads, tk = k.shape[1], k.shape[2]
    lib = library()
    if lib is None:
        raise RuntimeError("attention: the CPU kernels could not be built on this machine")
    out = torch.empty(batch, tq, heads, d, dtype=torch.float32).permute(0, 2, 1, 3)
    strides = [torch.tensor(t.stride()[:3], dtype=torch.int64) for t in (q, k, v, out)]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if lib.attention_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), batch, heads, kv_heads, tq, tk,
                         d, *(s.data_ptr() for s in strides), scale, threads()):
        raise MemoryError("attention: scratch allocation failed")
    return out
