"""Decode attention over the paged KV cache on the CPU (csrc/paged_decode.c): the same contract as
``genserve.kernels.paged_decode_attention`` (the Triton kernel), for fp32 or bf16 caches."""

from __future__ import annotations

import math

import torch

from genserve.kernels._cpu_library import library, threads


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True for CPU tensors with contiguous fp32/bf16 caches of one dtype, when the kernels built here."""
    return (q.device.type == "cpu" and k_cache.device.type == "cpu" and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in (torch.float32, torch.bfloat16) and q.dtype in (torch.float32, torch.bfloat16)
            and k_cache.is_contiguous() and v_cache.is_contiguous() and library() is not None)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, *, sm_scale: float | None = None) -> torch.Tensor:
    """softmax(q K_b^T * sm_scale) V_b per sequence b: q (B, Hq, D), caches (num_blocks, block_size, Hkv, D),
    block_tables int32 (B, max_blocks), context_lens int32 (B,) -> (B, Hq, D) in q's dtype; a sequence with no
    context gets zeros. Check ``supports`` first."""
    batch, hq, d = q.shape
    _, block_size, hkv, dk = k_cache.shape
    if v_cache.shape != k_cache.shape or dk != d or hq % hkv:
        raise ValueError(f"paged_decode: q {tuple(q.shape)} and caches {tuple(k_cache.shape)}/"
                         f"{tuple(v_cache.shape)} do not fit (Hq % Hkv == 0, one head dim)")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"paged_decode: block_tables {tuple(block_tables.shape)} and context_lens "
                         f"{tuple(context_lens.shape)} must have one row per sequence ({batch})")
    if batch and int(context_lens.max()) > block_tables.shape[1] * block_size:
        raise ValueError("paged_decode: a context length exceeds its block table")
    lib = library()
    if lib is None:
        raise RuntimeError("paged_decode: the CPU kernels could not be built on this machine")
    qf = q.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty(batch, hq, d, dtype=torch.float32)
    fn = lib.paged_decode_f32 if k_cache.dtype == torch.float32 else lib.paged_decode_bf16
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if fn(qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
          batch, hq, hkv, d, block_size, tables.shape[1], scale, threads()):
        raise MemoryError("paged_decode: scratch allocation failed")
    return out.to(q.dtype)
