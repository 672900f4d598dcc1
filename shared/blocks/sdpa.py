"""Scaled dot-product attention written out (Def. 12, "Scaled Dot-Product Attention", of the chapter
"Deep Learning Building Blocks"), with GQA by grouping query heads (Def. 17, "Multi-Query and Grouped-Query Attention").

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V

Query head i reads key/value head g(i) = i // (Hq / Hkv), so K and V are never copied per query head: the Hq query
heads are viewed as (Hkv, G) and broadcast against the Hkv key/value heads.

Two variants of the scores that served models use: logit soft-capping, s -> c tanh(s / c) before the mask (Gemma 2;
Team Gemma 2024), and attention sinks, one learned logit per head appended to every row of scores and dropped after
the softmax, so a head may give part of its attention to nothing (gpt-oss; Xiao et al. 2023, "Efficient Streaming
Language Models with Attention Sinks").
"""

from __future__ import annotations

import math

import torch


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) -> (B, Hq, Nq, Dv).

    `mask` is a bool keep-mask or an additive float mask broadcastable to (B, Hq, Nq, Nk). Softmax runs in float32.
    `softcap` > 0 caps the scaled scores at +-softcap; `sinks` (Hq,) are the heads' sink logits (module docstring).
    """
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"n_heads ({hq}) must be a multiple of n_kv_heads ({hkv})")
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qg = q.reshape(b, hkv, g, nq, d)  # (B, Hkv, G, Nq, D)
    scores = torch.matmul(qg.float(), k.float().unsqueeze(2).transpose(-1, -2)) * scale  # (B, Hkv, G, Nq, Nk)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        m = mask.expand(b, hq, nq, nk).reshape(b, hkv, g, nq, nk)
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.float()
    if sinks is not None:
        sink = sinks.float().reshape(1, hkv, g, 1, 1).expand(b, hkv, g, nq, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float().unsqueeze(2))  # (B, Hkv, G, Nq, Dv)
    return out.reshape(b, hq, nq, v.shape[-1]).to(v.dtype)
