"""Decode attention for multi-head latent attention (DeepSeek-V2/V3, `shared/blocks/mla.py`) over its paged latent
cache, in the absorbed form (DeepSeek-V2, Sec. 2.1.2: W^UK folds into the query and W^UV into the output).

Every head's query is [W^UK^T q_nope | RoPE(q_rope)], d_c + d_r wide, and every cached entry [c_KV | RoPE(k_R)]
serves as the key of all heads, its first d_c values as their value: one key/value head shared by every query head,
576 wide at DeepSeek-V3's sizes (d_c = 512, d_r = 64), past the generic paged kernel's 256.

One program serves a block of query heads of one sequence (and one split of its context, as in
`paged_attention.py`): each tile of entries is loaded once and feeds the scores, then, from registers, the values,
the read that FlashMLA is built around. A score is the sum of two products (the latent part and the RoPE part), so
each part's width is padded to a power of two on its own instead of 576 to 1024. Split contexts leave (m, l,
unnormalised output) for the paged kernel's merge step.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from genserve.kernels._runtime import autotune_limit, dot_precision, interpreting, upcast_for_interpreter
from genserve.kernels.flash_attention import LOG2E, M_INIT, online_softmax_step
from genserve.kernels.paged_attention import (
    _SPLIT_GRANULE,
    check_tables,
    finish_split,
    merge_splits,
    split_bounds,
    split_buffers,
    split_count,
)

# Query heads per program: the M side of the tensor-core dots. 16 keeps the (heads, d_c) fp32 accumulator of
# DeepSeek-V3 at 32 KB of registers per program.
BLOCK_H = 16
AUTOTUNE_CONFIGS = [
    triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=2),
]
INTERPRET_CONFIG = triton.Config({"BLOCK_N": 16})


@triton.jit
def _mla_decode_kernel(
    Q, Cache, block_tables, context_lens, O, part_acc, part_m, part_l,
    stride_qb, stride_qh,
    stride_cb, stride_cs,
    stride_bt,
    stride_ob, stride_oh,
    stride_pab, stride_pah, stride_pas,
    stride_pmb, stride_pmh,
    n_heads, qk_scale, window,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, SINGLE_SPLIT: tl.constexpr, SPLIT_GRANULE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    start, end = split_bounds(context_lens, b, split, window, SPLIT_GRANULE)

    # -- the block's query heads, latent part (BLOCK_H, BLOCK_C) and RoPE part (BLOCK_H, BLOCK_R) --
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    head_ok = heads < n_heads
    c_ok = offs_c < LATENT
    r_ok = offs_r < ROPE
    b64 = b.to(tl.int64)
    q_row = Q + b64 * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_c[None, :], mask=head_ok[:, None] & c_ok[None, :], other=0.0)
    q_rope = tl.load(q_row + LATENT + offs_r[None, :], mask=head_ok[:, None] & r_ok[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], M_INIT, dtype=tl.float32)

    table = block_tables + b64 * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        tokens = start_n + offs_n
        tok_ok = tokens < end
        blocks = tl.load(table + tokens // PAGE_SIZE, mask=tok_ok, other=0).to(tl.int64)
        entry = Cache + blocks * stride_cb + (tokens % PAGE_SIZE) * stride_cs  # (BLOCK_N,) pointers
        latent = tl.load(entry[:, None] + offs_c[None, :], mask=tok_ok[:, None] & c_ok[None, :], other=0.0)
        k_rope = tl.load(entry[None, :] + LATENT + offs_r[:, None], mask=tok_ok[None, :] & r_ok[:, None], other=0.0)
        if UPCAST:
            latent = latent.to(tl.float32)
            k_rope = k_rope.to(tl.float32)
        # -- scores over [c_KV | k_R], then the online-softmax update with the same latent tile as the values --
        qk = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
        qk = tl.dot(q_rope, k_rope, qk, input_precision=DOT_PRECISION)
        qk = tl.where(tok_ok[None, :], qk, float("-inf"))
        acc, l_i, m_i = online_softmax_step(qk, qk_scale, m_i, l_i, acc, latent, DOT_PRECISION)

    finish_split(acc, l_i, m_i, O, part_acc, part_m, part_l, b64, heads, head_ok, offs_c, c_ok, split,
                 stride_ob, stride_oh, stride_pab, stride_pah, stride_pas, stride_pmb, stride_pmh, SINGLE_SPLIT)


@functools.cache
def _tuned_kernel() -> triton.runtime.Autotuner:
    return triton.autotune(configs=autotune_limit(AUTOTUNE_CONFIGS),
                           key=["BLOCK_C", "BLOCK_R", "PAGE_SIZE", "SINGLE_SPLIT"])(_mla_decode_kernel)


def _check_inputs(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  latent_dim: int) -> None:
    if q.dim() != 3 or cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != q.shape[2]:
        raise ValueError(f"expected q (B, H, d_c + d_r) and a cache (num_blocks, block_size, 1, d_c + d_r); got "
                         f"{tuple(q.shape)} and {tuple(cache.shape)}")
    if not 0 < latent_dim < q.shape[2]:
        raise ValueError(f"latent_dim must be in 1..{q.shape[2] - 1} (the entry's width less its RoPE part); "
                         f"got {latent_dim}")
    check_tables(cache.shape[1], block_tables, context_lens, q.shape[0])
    if cache.dtype != q.dtype:
        raise ValueError(f"q and the cache must share a dtype; got {q.dtype}, {cache.dtype}")
    if cache.stride(-1) != 1 or cache.stride(1) != cache.shape[3]:
        raise ValueError("the cache's entries must be contiguous")


def mla_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    latent_dim: int,
    sm_scale: float | None = None,
    window: int = 0,
    max_context_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """softmax(q E_b^T * sm_scale) E_b[:, :latent_dim] for each sequence b's cached entries E_b -> o (B, H,
    latent_dim): q (B, H, d_c + d_r) absorbed queries, cache (num_blocks, block_size, 1, d_c + d_r). ``window`` > 0:
    only the last ``window`` entries. ``max_context_len`` and ``num_splits`` as in ``paged_decode_attention``."""
    _check_inputs(q, cache, block_tables, context_lens, latent_dim)
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    batch, n_heads, width = q.shape
    rope_dim = width - latent_dim
    block_size = cache.shape[1]
    sm_scale = 1.0 / math.sqrt(width) if sm_scale is None else sm_scale
    o = torch.empty((batch, n_heads, latent_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return o
    head_blocks = triton.cdiv(n_heads, BLOCK_H)
    num_splits = split_count(block_tables, block_size, head_blocks, max_context_len, num_splits, q.device)
    single = num_splits == 1
    part_acc, part_m, part_l = split_buffers(batch, n_heads, num_splits, latent_dim, q.device)

    args = (
        q, cache, block_tables, context_lens, o, part_acc, part_m, part_l,
        q.stride(0), q.stride(1),
        cache.stride(0), cache.stride(1),
        block_tables.stride(0),
        o.stride(0), o.stride(1),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_m.stride(0), part_m.stride(1),
        n_heads, sm_scale * LOG2E, window,
    )
    block_c = max(16, triton.next_power_of_2(latent_dim))
    meta = dict(
        LATENT=latent_dim, ROPE=rope_dim, BLOCK_C=block_c, BLOCK_R=max(16, triton.next_power_of_2(rope_dim)),
        PAGE_SIZE=block_size, BLOCK_H=BLOCK_H, SINGLE_SPLIT=single, SPLIT_GRANULE=_SPLIT_GRANULE,
        UPCAST=upcast_for_interpreter(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
    )
    grid = (batch, head_blocks, num_splits)
    if interpreting():
        _mla_decode_kernel[grid](*args, **meta, **INTERPRET_CONFIG.kwargs)
    else:
        _tuned_kernel()[grid](*args, **meta)
    merge_splits(part_acc, part_m, part_l, o, num_splits, latent_dim, block_c)
    return o
