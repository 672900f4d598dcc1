"""Joint attention over two token streams (Esser et al. 2024, "Scaling Rectified Flow Transformers for
High-Resolution Image Synthesis", §4 and Fig. 2b, the MMDiT block): the image and text tokens each get their own
Q/K/V projections (``to_q/to_k/to_v`` and ``add_q_proj/add_k_proj/add_v_proj``) and their own output projection
(``to_out.0`` and ``to_add_out``), but attend as ONE sequence, so text reads image and image reads text in a single
softmax. Optional QK-norm (§5.3.1: RMSNorm on each head's queries and keys, per stream) keeps the logits bounded in
large models. With rotary positions (Flux) the caller passes cos/sin for the joined sequence.

A stream with ``context_pre_only`` (the last SD3 block's text) has no output projection: its tokens only serve as
keys and values. Attention runs through the backend (SDPA or flash attention on the GPU). Names follow diffusers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from genserve.shared.blocks.backend import Backend, get_backend


class HeadRMSNorm(nn.Module):
    """RMSNorm over the last dim (each head's D channels), with a learned weight; diffusers' qk_norm="rms_norm"."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (x_{2i}, x_{2i+1}) by the angles whose cos/sin are given, (N, D) each with every
    angle repeated twice (Su et al. 2021, eq. 34; Flux's interleaved layout). x (B, H, N, D)."""
    x_pairs = x.float().unflatten(-1, (-1, 2))  # (B, H, N, D/2, 2)
    rotated = torch.stack((-x_pairs[..., 1], x_pairs[..., 0]), dim=-1).flatten(-2)  # (-x_odd, x_even)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class JointAttention(nn.Module):
    """(x (B, N, dim), context (B, M, dim)) -> (x_out (B, N, dim), context_out (B, M, dim) or None)."""

    def __init__(self, dim: int, n_heads: int, head_dim: int, *, qk_norm: bool, context_pre_only: bool = False,
                 has_context: bool = True, out_proj: bool = True, context_first: bool = False, eps: float = 1e-6,
                 backend: Backend | None = None) -> None:
        super().__init__()
        inner = n_heads * head_dim
        self.n_heads, self.head_dim = n_heads, head_dim
        self.context_first = context_first  # Flux orders the joined sequence [text, image]; SD3 [image, text]
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner) for _ in range(3))
        self.norm_q = HeadRMSNorm(head_dim, eps) if qk_norm else None
        self.norm_k = HeadRMSNorm(head_dim, eps) if qk_norm else None
        if has_context:
            self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, inner) for _ in range(3))
            self.norm_added_q = HeadRMSNorm(head_dim, eps) if qk_norm else None
            self.norm_added_k = HeadRMSNorm(head_dim, eps) if qk_norm else None
            if not context_pre_only:
                self.to_add_out = nn.Linear(inner, dim)
        self.has_context, self.context_pre_only = has_context, context_pre_only
        if out_proj:
            self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.out_proj = out_proj
        self.backend = backend or get_backend()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, N, D)

    def _qkv(self, x: torch.Tensor, q, k, v, norm_q, norm_k) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qh, kh, vh = self._heads(q(x)), self._heads(k(x)), self._heads(v(x))
        if norm_q is not None:
            qh, kh = norm_q(qh), norm_k(kh)
        return qh, kh, vh

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, n, _ = x.shape
        q, k, v = self._qkv(x, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k)
        m = 0
        if context is not None:
            m = context.shape[1]
            cq, ck, cv = self._qkv(context, self.add_q_proj, self.add_k_proj, self.add_v_proj, self.norm_added_q,
                                   self.norm_added_k)
            parts = ((cq, q), (ck, k), (cv, v)) if self.context_first else ((q, cq), (k, ck), (v, cv))
            q, k, v = (torch.cat(pair, dim=2) for pair in parts)  # (B, H, N + M, D)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        o = self.backend.attend(q, k, v, causal=False, sm_scale=1.0 / math.sqrt(self.head_dim))
        o = o.transpose(1, 2).reshape(b, n + m, self.n_heads * self.head_dim)  # (B, N + M, inner)
        if context is None:
            return (self.to_out[0](o) if self.out_proj else o), None
        x_o, c_o = (o[:, m:], o[:, :m]) if self.context_first else (o[:, :n], o[:, n:])
        x_o = self.to_out[0](x_o) if self.out_proj else x_o
        c_o = None if self.context_pre_only else self.to_add_out(c_o)
        return x_o, c_o
