"""Rotary position embeddings (Definition 15, "Rotary Position Embedding", of the chapter
"Deep Learning Building Blocks") applied to q and k in place, in one pass over both.

Each pair of coordinates (x_a, x_b) of a head is rotated by the planar rotation R(m theta_i):
    x_a' = x_a cos(m theta_i) - x_b sin(m theta_i),    x_b' = x_b cos(m theta_i) + x_a sin(m theta_i).
The pairing is the only difference between the two conventions:
- rotate-half (HF Llama/Mistral/Qwen2): pair i is (x_i, x_{i + R/2});
- interleaved (the chapter's block-diagonal R_Theta,m, GPT-J): pair i is (x_{2i}, x_{2i+1}).
The tables are the blocks' `rope_cos_sin` tables, (P, R/2) with R the rotary width: R = D rotates every coordinate;
R < D (partial rotary) rotates the first R and leaves the rest untouched.

Layout. q and k are (B, H, T, D), the backend contract's layout, with any strides as long as D is contiguous: a
token-major (B, T, H, D) tensor passed as `.transpose(1, 2)` is rotated in its own memory. Packed (T, H, D)
tensors are accepted too. One program rotates every head of q and k for one token, so the cos/sin row is loaded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    base, stride_h, n_heads, cos, sin, first, second, pair_ok,
    H_PAD: tl.constexpr,
):
    heads = tl.arange(0, H_PAD)
    mask = (heads < n_heads)[:, None] & pair_ok[None, :]
    rows = base + heads[:, None] * stride_h
    # -- load both halves of every pair, (H_PAD, HALF_PAD) each, and rotate in fp32 --
    x_a = tl.load(rows + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x_b = tl.load(rows + second[None, :], mask=mask, other=0.0).to(tl.float32)
    out_a = x_a * cos[None, :] - x_b * sin[None, :]
    out_b = x_b * cos[None, :] + x_a * sin[None, :]
    tl.store(rows + first[None, :], out_a.to(base.dtype.element_ty), mask=mask)
    tl.store(rows + second[None, :], out_b.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, COS, SIN, POS,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_cos, stride_sin, stride_pb, stride_pt,
    seq_len, n_q_heads, n_kv_heads, half, n_positions,
    INTERLEAVED: tl.constexpr, HALF_PAD: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    t = (pid % seq_len).to(tl.int64)

    # -- cos(m theta_i), sin(m theta_i) for this token's position m --
    pos = tl.load(POS + b * stride_pb + t * stride_pt).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)
    pair_ok = offs_i < half
    # a position past the tables reads nothing (and rotates to zeros) rather than memory past their end;
    # the position is broadcast to the tile because the interpreter rejects a scalar-and-tensor mask
    row_ok = pair_ok & ((pos + 0 * offs_i) < n_positions)
    cos = tl.load(COS + pos * stride_cos + offs_i, mask=row_ok, other=0.0).to(tl.float32)
    sin = tl.load(SIN + pos * stride_sin + offs_i, mask=row_ok, other=0.0).to(tl.float32)

    # -- which coordinates form pair i --
    if INTERLEAVED:
        first = 2 * offs_i
        second = 2 * offs_i + 1
    else:
        first = offs_i
        second = offs_i + half

    _rotate_heads(Q + b * stride_qb + t * stride_qt, stride_qh, n_q_heads, cos, sin, first, second, pair_ok, HQ_PAD)
    _rotate_heads(K + b * stride_kb + t * stride_kt, stride_kh, n_kv_heads, cos, sin, first, second, pair_ok, HK_PAD)


def _as_bhtd(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() == 3:  # packed (T, H, D) -> a (1, H, T, D) view of the same memory
        return x.transpose(0, 1)[None]
    if x.dim() != 4:
        raise ValueError(f"{name} must be (B, H, T, D) or (T, H, D); got {tuple(x.shape)}")
    return x


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    *,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, Hq, T, D) and k (B, Hkv, T, D) by R_Theta,m (the chapter's equation ROPE QK); returns (q, k).

    cos/sin are (P, R/2) tables; positions are (T,) or (B, T) row indices < P into them, or None for 0..T-1. The
    rotation is in place when D is contiguous in memory, otherwise on a contiguous copy: always use the returned
    tensors.
    """
    q4, k4 = _as_bhtd(q, "q"), _as_bhtd(k, "k")
    batch, n_q_heads, seq_len, head_dim = q4.shape
    if k4.shape[0] != batch or k4.shape[2] != seq_len or k4.shape[3] != head_dim:
        raise ValueError(f"q and k must agree on (B, T, D); got {tuple(q.shape)} and {tuple(k.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape or 2 * cos.shape[1] > head_dim:
        raise ValueError(f"cos/sin must be (P, R/2) with R <= D={head_dim}; got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
        q4 = _as_bhtd(q, "q")
    if k.stride(-1) != 1:
        k = k.contiguous()
        k4 = _as_bhtd(k, "k")
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()

    if positions is None:
        positions = torch.arange(seq_len, device=q.device)
    if positions.dim() == 1:
        positions = positions[None].expand(batch, seq_len)  # stride 0 over the batch
    if positions.shape != (batch, seq_len):
        raise ValueError(f"positions must be (T,) or (B, T) with B={batch}, T={seq_len}; got {tuple(positions.shape)}")

    half = cos.shape[1]
    half_pad, hq_pad = triton.next_power_of_2(half), triton.next_power_of_2(n_q_heads)
    if batch * seq_len > 0:
        _rope_kernel[(batch * seq_len,)](
            q4, k4, cos, sin, positions,
            q4.stride(0), q4.stride(1), q4.stride(2),
            k4.stride(0), k4.stride(1), k4.stride(2),
            cos.stride(0), sin.stride(0), positions.stride(0), positions.stride(1),
            seq_len, n_q_heads, k4.shape[1], half, cos.shape[0],
            INTERLEAVED=interleaved, HALF_PAD=half_pad, HQ_PAD=hq_pad, HK_PAD=triton.next_power_of_2(k4.shape[1]),
            num_warps=4 if hq_pad * half_pad <= 2048 else 8,
        )
    return q, k
