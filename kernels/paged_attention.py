"""Decode attention over a paged KV cache: one query token per sequence (Definition 16, "KV Cache", of the chapter
"Deep Learning Building Blocks").

The cache layout is the engine's (docs/architecture.md): `k_cache`/`v_cache` are (num_blocks, block_size, Hkv, D);
token t of sequence b lives in block `block_tables[b, t // block_size]`, slot `t % block_size`.

Decode reads every cached key and value once and does two dot products per element, so it is bound by HBM
bandwidth, not by compute. Two choices follow:
- GQA is native: one program serves all Hq / Hkv query heads of a KV head, so each K/V byte is read once, not once
  per query head. The group's query rows form the M side of a tensor-core dot (padded to 16 rows).
- Split-K (flash-decoding): when B * Hkv programs cannot fill the GPU (small batches, long contexts), each sequence's
  context is cut into splits that run in parallel; each split keeps its own online-softmax state (m, l, unnormalised
  output, as in Algorithm 3, "Flash Attention (Simplified)") and a second small kernel merges them by rescaling with
  exp(m_s - max_s m_s).
Soft-capping and attention sinks are those of the flash kernel (flash_attention.py); the sink enters only split 0's
state, so the merge counts it once.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from genserve.kernels._runtime import (
    autotune_limit,
    dot_precision,
    interpreting,
    sm_count,
    upcast_for_interpreter,
)
from genserve.kernels.flash_attention import LOG2E, M_INIT, MAX_HEAD_DIM, online_softmax_step, soft_cap

# Splits cover a multiple of this many tokens, a multiple of every BLOCK_N below, so tiles never straddle splits.
_SPLIT_GRANULE = 256
# Below this many tokens per split the merge step costs more than the parallelism it buys.
_MIN_TOKENS_PER_SPLIT = 512

# Autotune candidates for every GPU, sized on Hopper (sm_90): a few 16 KB K/V tiles in flight per program hide HBM
# latency.
AUTOTUNE_CONFIGS = [
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=2),
]
INTERPRET_CONFIG = triton.Config({"BLOCK_N": 32})


@triton.jit
def split_bounds(context_lens, b, split, window, SPLIT_GRANULE: tl.constexpr):
    """[start, end) of sequence b's context for this program's split: every sequence spreads over all the splits (in
    whole granules), so a short context in a launch sized for a long one (a CUDA graph sized by the model's maximum)
    still runs on many programs; with a sliding ``window`` > 0 only its last ``window`` keys, the query's own
    included, so earlier splits go empty. Shared with mla_decode.py."""
    context_len = tl.load(context_lens + b)
    tokens_per_split = tl.cdiv(tl.cdiv(context_len, tl.num_programs(2)), SPLIT_GRANULE) * SPLIT_GRANULE
    start = split * tokens_per_split
    end = tl.minimum(context_len, start + tokens_per_split)
    if window > 0:
        start = tl.maximum(start, context_len - window)
    return start, end


@triton.jit
def finish_split(acc, l_i, m_i, O, part_acc, part_m, part_l, b64, heads, head_ok, offs_d, d_ok, split,
                 stride_ob, stride_oh, stride_pab, stride_pah, stride_pas, stride_pmb, stride_pmh,
                 SINGLE_SPLIT: tl.constexpr):
    """A program's last step for its rows of query heads: with one split, normalise and write the output (an empty
    context gives zeros); otherwise leave (m, l, unnormalised output) for the merge kernel. Shared with
    mla_decode.py."""
    if SINGLE_SPLIT:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_i[:, None]
        o_ptrs = O + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])
    else:
        pa = part_acc + b64 * stride_pab + heads[:, None] * stride_pah + split * stride_pas + offs_d[None, :]
        tl.store(pa, acc, mask=head_ok[:, None] & d_ok[None, :])
        pm = b64 * stride_pmb + heads * stride_pmh + split
        tl.store(part_m + pm, m_i, mask=head_ok)
        tl.store(part_l + pm, l_i, mask=head_ok)


@triton.jit
def _paged_decode_kernel(
    Q, K_cache, V_cache, block_tables, context_lens, O, part_acc, part_m, part_l,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    stride_pab, stride_pah, stride_pas,
    stride_pmb, stride_pmh,
    group_size, qk_scale, window, softcap_in, softcap_out, Sinks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, SPLIT_GRANULE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tl.static_assert(BLOCK_D >= 16 and GROUP_PAD >= 16, "tensor-core dots need K >= 16 and M >= 16")
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    split = tl.program_id(2)

    start, end = split_bounds(context_lens, b, split, window, SPLIT_GRANULE)

    # -- the query heads of this KV group, (GROUP_PAD, D); padding rows load as zeros and are never stored --
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    head_ok = offs_g < group_size
    d_ok = offs_d < HEAD_DIM
    heads = kv_h * group_size + offs_g
    b64 = b.to(tl.int64)
    q_ptrs = Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], M_INIT, dtype=tl.float32)
    if SINKS:  # split 0 carries each head's sink (module docstring); 1.44.. = log2 e, into the base-2 softmax
        sink = tl.load(Sinks + heads, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)

    table = block_tables + b64 * stride_bt
    k_head = K_cache + kv_h.to(tl.int64) * stride_kh
    v_head = V_cache + kv_h.to(tl.int64) * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        # -- gather: token -> (physical block, slot) through the block table --
        tokens = start_n + offs_n
        tok_ok = tokens < end
        blocks = tl.load(table + tokens // PAGE_SIZE, mask=tok_ok, other=0).to(tl.int64)
        slots = tokens % PAGE_SIZE
        k_t = tl.load(
            k_head + blocks[None, :] * stride_kb + slots[None, :] * stride_ks + offs_d[:, None],
            mask=tok_ok[None, :] & d_ok[:, None], other=0.0,
        )
        v = tl.load(
            v_head + blocks[:, None] * stride_vb + slots[:, None] * stride_vs + offs_d[None, :],
            mask=tok_ok[:, None] & d_ok[None, :], other=0.0,
        )
        if UPCAST:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)
        # -- scores in log2 units, then the online-softmax update (steps 7-10) of Algorithm 3,
        # "Flash Attention (Simplified)" --
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION)
        if SOFTCAP:
            qk = soft_cap(qk, softcap_in, softcap_out)
        qk = tl.where(tok_ok[None, :], qk, float("-inf"))
        acc, l_i, m_i = online_softmax_step(qk, qk_scale, m_i, l_i, acc, v, DOT_PRECISION)

    finish_split(acc, l_i, m_i, O, part_acc, part_m, part_l, b64, heads, head_ok, offs_d, d_ok, split,
                 stride_ob, stride_oh, stride_pab, stride_pah, stride_pas, stride_pmb, stride_pmh, SINGLE_SPLIT)


@triton.jit
def _merge_splits_kernel(
    part_acc, part_m, part_l, O,
    stride_pab, stride_pah, stride_pas,
    stride_pmb, stride_pmh,
    stride_ob, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    split_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    # -- O = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s with m = max_s m_s; empty splits have l_s = 0 --
    m_s = tl.load(part_m + b * stride_pmb + h * stride_pmh + offs_s, mask=split_ok, other=M_INIT)
    l_s = tl.load(part_l + b * stride_pmb + h * stride_pmh + offs_s, mask=split_ok, other=0.0)
    acc_s = tl.load(
        part_acc + b * stride_pab + h * stride_pah + offs_s[:, None] * stride_pas + offs_d[None, :],
        mask=split_ok[:, None] & d_ok[None, :], other=0.0,
    )
    w = tl.exp2(m_s - tl.max(m_s, 0))
    l = tl.sum(w * l_s, 0)
    l = tl.where(l == 0.0, 1.0, l)
    o = tl.sum(w[:, None] * acc_s, 0) / l
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, o.to(O.dtype.element_ty), mask=d_ok)


@functools.cache
def _tuned_kernel() -> triton.runtime.Autotuner:
    return triton.autotune(configs=autotune_limit(AUTOTUNE_CONFIGS),
                           key=["BLOCK_D", "PAGE_SIZE", "GROUP_PAD", "SINGLE_SPLIT"])(_paged_decode_kernel)


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q (B, Hq, D) and caches (num_blocks, block_size, Hkv, D); got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    batch, n_q_heads, head_dim = q.shape
    _, block_size, n_kv_heads, cache_head_dim = k_cache.shape
    if head_dim != cache_head_dim or not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must match and be 1..{MAX_HEAD_DIM}; got {head_dim} and {cache_head_dim}")
    if n_q_heads % n_kv_heads != 0:
        raise ValueError(f"query heads ({n_q_heads}) must be a multiple of key/value heads ({n_kv_heads})")
    check_tables(block_size, block_tables, context_lens, batch)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q and the caches must share a dtype; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")


def check_tables(block_size: int, block_tables: torch.Tensor, context_lens: torch.Tensor, batch: int) -> None:
    """The page size and the per-sequence tables a paged decode kernel reads (shared with mla_decode.py)."""
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two; got {block_size}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(
            f"block_tables must be (B, max_blocks) and context_lens (B,) with B={batch}; got "
            f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}"
        )
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError(f"block_tables and context_lens must be int32; got {block_tables.dtype}, {context_lens.dtype}")


def choose_num_splits(batch: int, n_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """Enough programs for about two waves over the SMs, but never splits shorter than _MIN_TOKENS_PER_SPLIT."""
    wanted = triton.cdiv(2 * sm_count(device), batch * n_kv_heads)
    return max(1, min(wanted, max_context_len // _MIN_TOKENS_PER_SPLIT))


def split_count(block_tables: torch.Tensor, block_size: int, heads: int, max_context_len: int | None,
                num_splits: int | None, device: torch.device) -> int:
    """The splits of each sequence's context for a launch of `heads` programs per sequence and split: `num_splits`,
    or choose_num_splits' over `max_context_len` (default: the block table's capacity, which needs no device-to-host
    copy), never more than that bound has granules (past that every sequence would leave splits empty)."""
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(block_tables.shape[0], heads, max_context_len, device)
    return max(1, min(num_splits, triton.cdiv(max(max_context_len, 1), _SPLIT_GRANULE)))


def split_buffers(batch: int, n_heads: int, num_splits: int, width: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(part_acc, part_m, part_l): each split's unnormalised output and softmax state for the merge kernel; with one
    split never touched, one-element buffers that keep the kernel's signature fixed."""
    if num_splits == 1:
        part_m = torch.empty((1, 1, 1), dtype=torch.float32, device=device)
        return torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device), part_m, part_m
    part_m = torch.empty((batch, n_heads, num_splits), dtype=torch.float32, device=device)
    return (torch.empty((batch, n_heads, num_splits, width), dtype=torch.float32, device=device), part_m,
            torch.empty_like(part_m))


def merge_splits(part_acc: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor, o: torch.Tensor,
                 num_splits: int, width: int, block_d: int) -> None:
    """o (B, H, width) from the splits' states left by a split launch (a no-op for one split)."""
    if num_splits == 1:
        return
    _merge_splits_kernel[(o.shape[0], o.shape[1])](
        part_acc, part_m, part_l, o,
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_m.stride(0), part_m.stride(1),
        o.stride(0), o.stride(1),
        num_splits,
        HEAD_DIM=width, BLOCK_D=block_d, SPLITS_PAD=triton.next_power_of_2(num_splits),
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q K_b^T * sm_scale) V_b for each sequence b's cached keys/values -> o (B, Hq, D); with ``window`` > 0
    only the last ``window`` keys of each sequence (Mistral's sliding window). ``softcap`` and ``sinks`` (Hq,) as in
    ``flash_attention``.

    `max_context_len` is the expected longest context, used only to choose the split count (a wrong value costs
    speed, not correctness); by default it is the block table's capacity (max_blocks * block_size), which needs no
    device-to-host copy. `num_splits` overrides the choice. Each sequence cuts its own context into up to that many
    splits of whole 256-token granules, so a short context keeps its parallelism in a launch sized for a long one.
    Sequences with context length 0 produce zeros.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must hold one logit per query head ({q.shape[1]}); got {tuple(sinks.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' head dim must be contiguous")
    batch, n_q_heads, head_dim = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = n_q_heads // n_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    o = torch.empty_like(q)
    if batch == 0:
        return o

    num_splits = split_count(block_tables, block_size, n_kv_heads, max_context_len, num_splits, q.device)
    single = num_splits == 1
    part_acc, part_m, part_l = split_buffers(batch, n_q_heads, num_splits, head_dim, q.device)

    args = (
        q, k_cache, v_cache, block_tables, context_lens, o, part_acc, part_m, part_l,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        o.stride(0), o.stride(1),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_m.stride(0), part_m.stride(1),
        group_size, sm_scale * LOG2E, window, sm_scale / softcap if softcap else 1.0,
        softcap / sm_scale if softcap else 1.0, sinks.float().contiguous() if sinks is not None else part_m,
    )
    block_d = max(16, triton.next_power_of_2(head_dim))
    meta = dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=block_size, GROUP_PAD=max(16, triton.next_power_of_2(group_size)),
        SINGLE_SPLIT=single, SPLIT_GRANULE=_SPLIT_GRANULE, UPCAST=upcast_for_interpreter(q.dtype),
        DOT_PRECISION=dot_precision(q.dtype), SOFTCAP=softcap > 0, SINKS=sinks is not None,
    )
    grid = (batch, n_kv_heads, num_splits)
    if interpreting():
        _paged_decode_kernel[grid](*args, **meta, **INTERPRET_CONFIG.kwargs)
    else:
        _tuned_kernel()[grid](*args, **meta)

    merge_splits(part_acc, part_m, part_l, o, num_splits, head_dim, block_d)
    return o
