"""Flash attention forward: Algorithm 3 ("Flash Attention (Simplified)") of the chapter "Deep Learning Building Blocks",
with the FlashAttention-2 work split (Remark 12, "FlashAttention-2 and Beyond").

One program owns one query block Q_i of one (sequence, query head) and streams the key/value blocks (K_j, V_j) of
that head's KV group past it, keeping the running row maxima m, row sums l and the unnormalised output in registers.
HBM traffic is therefore Theta(N^2 d^2 / M) (Proposition 2, "IO Complexity of Flash Attention"): the N x N score
matrix is never written.

Choices that the algorithm leaves open:
- GQA/MQA is native: query head h reads KV head h // (Hq // Hkv); K and V are never expanded.
- Causal masking is bottom-right aligned (query i sees keys j <= i + Nk - Nq), so chunked prefill with Nq < Nk works;
  a sliding window (Mistral) adds the lower edge j > i + Nk - Nq - window and starts the key loop at it.
- The softmax runs in base 2: log2(e) is folded into the scale, so each score costs one FMA and one exp2.
- The key loop runs in two phases: blocks wholly visible to every query row skip the score mask; only the blocks
  that cross the causal diagonal or the end of the keys pay for it.
- Ragged batches are either padded (B, H, N, D) tensors or packed (total, H, D) tensors with `cu_seqlens`.
- Any head dims up to 256, and a value head dim that differs from the query/key one (MLA): tiles are padded to
  powers of two (at least 16, the tensor-core minimum) and the padding columns are masked off.
- Soft-capping (Gemma 2) maps each raw score s to c tanh(s sm_scale / c) / sm_scale before the mask, so the usual
  scale then gives c tanh(s sm_scale / c); tanh is 2 sigmoid(2x) - 1. Attention sinks (gpt-oss) start each row's
  running softmax state at the head's sink logit, m = sink and l = 1 with nothing accumulated: the sink joins the
  denominator and adds nothing to the output.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from genserve.kernels._runtime import autotune_limit, dot_precision, interpreting, upcast_for_interpreter

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
# A running maximum that starts finite: a fully masked block then yields exp2(-inf - m) = 0, never NaN.
M_INIT = tl.constexpr(-1.0e30)

# Autotune candidates for every GPU, sized on Hopper (sm_90): 128-row query tiles keep the wgmma units busy and 3
# stages of K/V tiles fit its 228 KB of shared memory; on a GPU with less, the autotuner drops those that do not fit
# (a config that fails with OutOfResources is timed as infinitely slow).
AUTOTUNE_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=2),
]
# fp32 tiles take twice the shared memory of 16-bit ones: at padded head dims of 128 and more (diffusion's 80 and 160)
# few or none of the candidates above fit on sm_90, so these narrower ones stand in for them there.
NARROW_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=2),
]
# A tile of BLOCK_M rows x (padded) head dim in fp32 spread over the program's threads; beyond 64 registers a thread
# (the score tile needs as many again) ptxas spills on sm_90 (128 x 128 over 4 warps spilled 320 bytes).
_MAX_TILE_REGS_PER_THREAD = 64
_SM90_SHARED_BYTES = 232448
# The interpreter runs one program at a time in numpy: fewer, larger tiles are faster there.
INTERPRET_CONFIG = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64})


@triton.jit
def online_softmax_step(qk, qk_scale, m_i, l_i, acc, v, DOT_PRECISION: tl.constexpr):
    """Algorithm 3 ("Flash Attention (Simplified)"), steps 8-10, for one block of raw scores qk (rows, BLOCK_N),
    masked entries -inf, in base 2 (qk_scale includes log2 e): m_new = max(m, rowmax(S) * scale), then the running
    sums l and the unnormalised output rescaled by exp2(m - m_new) plus this block's exp2(S * scale - m_new) and its
    product with V. Returns (acc, l, m_new). Shared by this kernel and the paged decode kernel."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def soft_cap(qk, softcap_in, softcap_out):
    """Raw scores -> c tanh(s sm_scale / c) / sm_scale, with softcap_in = sm_scale / c and softcap_out = c / sm_scale
    (module docstring); shared with the paged decode kernel."""
    return (2.0 * tl.sigmoid(2.0 * qk * softcap_in) - 1.0) * softcap_out


@triton.jit
def _attend_kv_blocks(
    acc, l_i, m_i, q,
    k_base, v_base, stride_kn, stride_vn,
    offs_m, offs_d, offs_dv, lo, hi, seqlen_k, causal_offset, window, qk_scale, softcap_in, softcap_out,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_SCORES: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < seqlen_k
        # -- load K_j^T (D, BLOCK_N) and V_j (BLOCK_N, Dv) from HBM (step 6) --
        k_t = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None], mask=col_ok[None, :] & d_ok[:, None],
                      other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_dv[None, :], mask=col_ok[:, None] & dv_ok[None, :],
                    other=0.0)
        if UPCAST:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)
        # -- S_ij = Q_i K_j^T on chip (step 7); the scale is applied below, fused with the max subtraction --
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION)
        if SOFTCAP:
            qk = soft_cap(qk, softcap_in, softcap_out)
        if MASK_SCORES:
            keep = col_ok[None, :]
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + causal_offset)
            if WINDOW:
                keep = keep & (cols[None, :] > offs_m[:, None] + causal_offset - window)
            qk = tl.where(keep, qk, float("-inf"))
        # -- new maxima, rescaled partial sums, plus exp(S_ij - m_new) V_j (steps 8-10) --
        acc, l_i, m_i = online_softmax_step(qk, qk_scale, m_i, l_i, acc, v, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _flash_attention_fwd_kernel(
    Q, K, V, O, cu_seqlens_q, cu_seqlens_k,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    n_q_heads, group_size, seqlen_q, seqlen_k, window, qk_scale, seq_bucket, softcap_in, softcap_out, Sinks,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # seq_bucket only keys the autotuner: configs are tuned per power-of-two length band, not per length.
    tl.static_assert(BLOCK_D >= 16 and BLOCK_DV >= 16, "tensor-core dots need K >= 16: pad the head dims")
    pid_m = tl.program_id(0)
    if CAUSAL:
        # The last query blocks see the most keys: launch them first so the short ones fill the tail wave.
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // n_q_heads
    h = pid_bh % n_q_heads
    kv_h = h // group_size

    # -- where this sequence lives: its batch row, or its slice of the packed tokens --
    b64 = b.to(tl.int64)
    q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b64 * stride_kb + kv_h.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + kv_h.to(tl.int64) * stride_vh
    o_base = O + b64 * stride_ob + h.to(tl.int64) * stride_oh
    if VARLEN:
        q_start = tl.load(cu_seqlens_q + b)
        seqlen_q = tl.load(cu_seqlens_q + b + 1) - q_start
        k_start = tl.load(cu_seqlens_k + b)
        seqlen_k = tl.load(cu_seqlens_k + b + 1) - k_start
        q_base += q_start.to(tl.int64) * stride_qm
        k_base += k_start.to(tl.int64) * stride_kn
        v_base += k_start.to(tl.int64) * stride_vn
        o_base += q_start.to(tl.int64) * stride_om
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return

    # -- load Q_i once (step 4); initialise O, m, l (step 2) --
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    q_ptrs = q_base + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], M_INIT, dtype=tl.float32)
    if SINKS:  # the sink as a first key worth exp(sink) that carries no value (module docstring); 1.44.. = log2 e
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
        l_i = l_i + 1.0

    # -- the key range: [lo, n_full) needs no score mask, [n_full, hi) crosses the diagonal or the end --
    causal_offset = seqlen_k - seqlen_q
    n_full = (seqlen_k // BLOCK_N) * BLOCK_N
    hi = seqlen_k
    lo = 0
    if CAUSAL:
        hi = tl.minimum(seqlen_k, start_m + BLOCK_M + causal_offset)
        first_row_sees = tl.maximum(start_m + causal_offset + 1, 0)
        n_full = tl.minimum(n_full, (first_row_sees // BLOCK_N) * BLOCK_N)
    if WINDOW:
        # A sliding window has a second diagonal edge: start at the first block the first row sees, and mask every
        # block (the two edges leave few blocks that every row sees whole).
        lo = (tl.maximum(start_m + causal_offset - window + 1, 0) // BLOCK_N) * BLOCK_N
        n_full = lo

    # -- stream the key/value blocks (step 5) --
    acc, l_i, m_i = _attend_kv_blocks(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
        offs_m, offs_d, offs_dv, lo, n_full, seqlen_k, causal_offset, window, qk_scale, softcap_in, softcap_out,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, CAUSAL, WINDOW, UPCAST, DOT_PRECISION, SOFTCAP,
    )
    acc, l_i, m_i = _attend_kv_blocks(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
        offs_m, offs_d, offs_dv, n_full, hi, seqlen_k, causal_offset, window, qk_scale, softcap_in, softcap_out,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, CAUSAL, WINDOW, UPCAST, DOT_PRECISION, SOFTCAP,
    )

    # -- O_i = acc / l, written back to HBM (step 11); a row that sees no key gets zeros --
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_i[:, None]
    o_ptrs = o_base + offs_m[:, None] * stride_om + offs_dv[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :])


def padded_head_dim(head_dim: int) -> int:
    """The tile width for a head dim: a power of two, at least 16 (the tensor-core K minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


def autotune_configs(block_d: int, block_dv: int, elem_bytes: int = 2) -> list[triton.Config]:
    """The autotune candidates for padded head dims and an element size (2: fp16/bf16, 4: fp32): those whose tiles
    neither spill nor overflow shared memory; the narrow ones when none of the others fits. Never fewer than two
    where two fit, so the autotuner times them and drops one that fails to launch (OutOfResources) rather than
    launching a lone config untimed."""
    widest = max(block_d, block_dv)

    def fits(c: triton.Config) -> bool:
        m, n = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        shared = elem_bytes * (m * block_d + c.num_stages * n * (block_d + block_dv))  # Q once, K/V per stage
        return m * widest // (32 * c.num_warps) <= _MAX_TILE_REGS_PER_THREAD and shared <= _SM90_SHARED_BYTES

    fitting = [c for c in AUTOTUNE_CONFIGS if fits(c)]
    return fitting if len(fitting) > 1 else fitting + [c for c in NARROW_CONFIGS if fits(c)]


@functools.cache
def _tuned_kernel(block_d: int, block_dv: int, elem_bytes: int) -> triton.runtime.Autotuner:
    return triton.autotune(configs=autotune_limit(autotune_configs(block_d, block_dv, elem_bytes)),
                           key=["CAUSAL", "WINDOW", "VARLEN", "seq_bucket"])(_flash_attention_fwd_kernel)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: bool) -> None:
    dims = 3 if varlen else 4
    if q.dim() != dims or k.dim() != dims or v.dim() != dims:
        layout = "(total, H, D) with cu_seqlens" if varlen else "(B, H, N, D)"
        raise ValueError(f"q, k, v must be {layout}; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    n_q_heads, n_kv_heads = q.shape[1], k.shape[1]
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree but for the head dim; got {tuple(k.shape)} and {tuple(v.shape)}")
    if n_q_heads % n_kv_heads != 0:
        raise ValueError(f"query heads ({n_q_heads}) must be a multiple of key/value heads ({n_kv_heads})")
    if q.shape[-1] != k.shape[-1] or not 0 < q.shape[-1] <= MAX_HEAD_DIM or not 0 < v.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"q and k must share a head dim and every head dim must be 1..{MAX_HEAD_DIM}; got "
                         f"{q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one of fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")


def _seq_bucket(max_seqlen_q: int) -> int:
    """Powers of two from 256 to 16k: a serving process tunes at most seven bands per (causal, layout) pair."""
    return min(max(triton.next_power_of_2(max_seqlen_q), 256), 16384)


def _unit_stride_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * sm_scale [+ causal mask]) v, computed by Algorithm 3 ("Flash Attention (Simplified)") without
    materialising the scores. ``softcap`` > 0 caps the scaled scores at +-softcap; ``sinks`` (Hq,) adds each head's
    sink logit to its softmax denominator (module docstring).
    With ``window`` > 0 (causal only) query i also sees no key more than ``window`` - 1 positions before its own:
    i - window < j <= i in absolute positions (Mistral's sliding window, shared/blocks/masks.py).

    Padded form: q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) -> o (B, Hq, Nq, Dv).
    Packed (varlen) form: q (total_q, Hq, D), k/v (total_k, Hkv, D/Dv) with int32 `cu_seqlens_q`/`cu_seqlens_k` of
    shape (B + 1,) holding each sequence's start offset -> o (total_q, Hq, Dv). `max_seqlen_q` sizes the grid; when
    omitted it is read from `cu_seqlens_q` (one device-to-host copy).
    Any strides work as long as the head dim is contiguous. The padded output is laid out (B, Nq, Hq, Dv) in memory,
    so `o.transpose(1, 2).reshape(B, Nq, Hq * Dv)` is free. sm_scale defaults to 1 / sqrt(D).
    """
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    _check_inputs(q, k, v, varlen)
    if window < 0 or (window and not causal):
        raise ValueError(f"window must be >= 0 and needs causal attention; got window={window}, causal={causal}")
    q, k, v = _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v)
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale

    if varlen:
        n_q_heads, n_kv_heads = q.shape[1], k.shape[1]
        batch = cu_seqlens_q.numel() - 1
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if batch > 0 else 0
        o = q.new_empty((q.shape[0], n_q_heads, head_dim_v))
        # (total, H, D): no batch stride; the token stride moves along the packed sequence.
        q_strides = (0, q.stride(1), q.stride(0))
        k_strides = (0, k.stride(1), k.stride(0))
        v_strides = (0, v.stride(1), v.stride(0))
        o_strides = (0, o.stride(1), o.stride(0))
        cu_q, cu_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
        seqlen_q, seqlen_k = max_seqlen_q, 0
    else:
        batch, n_q_heads, seqlen_q, _ = q.shape
        n_kv_heads, seqlen_k = k.shape[1], k.shape[2]
        max_seqlen_q = seqlen_q
        o = q.new_empty((batch, seqlen_q, n_q_heads, head_dim_v)).transpose(1, 2)
        q_strides, k_strides, v_strides, o_strides = (tuple(t.stride()[:3]) for t in (q, k, v, o))
        # Unused when not VARLEN; any int32 tensor keeps the signature fixed.
        cu_q = cu_k = torch.zeros(1, dtype=torch.int32, device=q.device)
    if batch == 0 or max_seqlen_q == 0:
        return o

    if sinks is not None and sinks.shape != (n_q_heads,):
        raise ValueError(f"sinks must hold one logit per query head ({n_q_heads}); got {tuple(sinks.shape)}")
    sink_arg = sinks.float().contiguous() if sinks is not None else cu_q  # unread without SINKS
    args = (
        q, k, v, o, cu_q, cu_k, *q_strides, *k_strides, *v_strides, *o_strides,
        n_q_heads, n_q_heads // n_kv_heads, seqlen_q, seqlen_k, window, sm_scale * LOG2E,
        _seq_bucket(max_seqlen_q), sm_scale / softcap if softcap else 1.0, softcap / sm_scale if softcap else 1.0,
        sink_arg,
    )
    block_d, block_dv = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    meta = dict(
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv, CAUSAL=causal,
        WINDOW=window > 0, VARLEN=varlen,
        UPCAST=upcast_for_interpreter(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
        SOFTCAP=softcap > 0, SINKS=sinks is not None,
    )

    def grid(config: dict) -> tuple[int, int]:
        return (triton.cdiv(max_seqlen_q, config["BLOCK_M"]), batch * n_q_heads)

    if interpreting():
        tiles = INTERPRET_CONFIG.kwargs
        _flash_attention_fwd_kernel[grid(tiles)](*args, **meta, **tiles)
    else:
        _tuned_kernel(block_d, block_dv, q.element_size())[grid](*args, **meta)
    return o
