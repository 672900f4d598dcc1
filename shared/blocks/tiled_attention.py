"""Tiled attention with the online softmax, following Algorithm 3 ("Flash Attention (Simplified)") of the chapter
"Deep Learning Building Blocks" step by step in pure torch. It is the readable reference the Triton kernels are tested
against, not a fast path.

GQA is read natively (query heads grouped under their key/value head) and the causal mask is bottom-right aligned
(query i sees keys j <= i + Nk - Nq), matching the backend contract.
"""

from __future__ import annotations

import math

import torch


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float | None = None,
    block_q: int = 16,
    block_k: int = 16,
) -> torch.Tensor:
    """q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) -> (B, Hq, Nq, Dv), accumulated in float32."""
    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    if hq % hkv:
        raise ValueError(f"n_heads ({hq}) must be a multiple of n_kv_heads ({hkv})")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    offset = nk - nq  # bottom-right alignment of the causal diagonal
    qg = q.reshape(b, hkv, hq // hkv, nq, d).float()  # (B, Hkv, G, Nq, D)
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)  # (B, Hkv, 1, Nk, D)
    out = torch.empty(b, hkv, hq // hkv, nq, dv, dtype=torch.float32, device=q.device)

    # 1. T_r = ceil(Nq / B_r) query blocks, T_c = ceil(Nk / B_c) key/value blocks.
    for i0 in range(0, nq, block_q):
        i1 = min(i0 + block_q, nq)
        # 3a. load Q_i; 2. O_i = 0, m = -inf, l = 0 for its rows.
        q_i = qg[..., i0:i1, :]
        m = torch.full(q_i.shape[:-1], float("-inf"), device=q.device)
        l = torch.zeros(q_i.shape[:-1], device=q.device)
        acc = torch.zeros(*q_i.shape[:-1], dv, device=q.device)
        for j0 in range(0, nk, block_k):
            if causal and j0 > i1 - 1 + offset:
                break  # this and every later key block lies wholly above the diagonal
            j1 = min(j0 + block_k, nk)
            # 3b. load K_j, V_j; compute S_ij = Q_i K_j^T / sqrt(d_k) on chip.
            s = torch.matmul(q_i, kf[..., j0:j1, :].transpose(-1, -2)) * scale  # (B, Hkv, G, Br, Bc)
            if causal:
                rows = torch.arange(i0, i1, device=q.device)[:, None]
                cols = torch.arange(j0, j1, device=q.device)[None, :]
                s = s.masked_fill(cols > rows + offset, float("-inf"))
            # update the running max: m_new = max(m, rowmax(S_ij))
            m_new = torch.maximum(m, s.amax(dim=-1))
            # rows that have seen no visible key yet keep m = -inf; shift by 0 there so exp gives 0, not NaN
            shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - shift)  # exp(m_old - m_new), rescales what was accumulated so far
            p = torch.exp(s - shift[..., None])
            # rescale previous partial sums and add exp(S_ij - m_new) V_j; update the denominator l the same way
            acc = acc * alpha[..., None] + torch.matmul(p, vf[..., j0:j1, :])
            l = l * alpha + p.sum(dim=-1)
            m = m_new
        # 3c. write O_i = acc / l back.
        out[..., i0:i1, :] = acc / l[..., None]
    return out.reshape(b, hq, nq, dv).to(v.dtype)
