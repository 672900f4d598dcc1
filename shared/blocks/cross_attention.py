"""Cross-attention (the CrossAttn equation of the chapter "Deep Learning Building Blocks"): queries from one sequence
(image tokens), keys and values from another (text tokens). With context=None it is self-attention, which the U-Net and
the VAE mid-block also use.

Names follow diffusers (`to_q`, `to_k`, `to_v`, `to_out.0`) so its checkpoints map 1:1.

K_txt = X_txt W_K and V_txt = X_txt W_V do not depend on the image tokens, so a sampler that calls the denoiser many
times with one text (20 DDIM steps) needs them once per layer, not once per step: wrap the context in a
`ContextCache` and pass that instead of the tensor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from genserve.shared.blocks.backend import Backend, get_backend


class CrossAttention(nn.Module):
    """CrossAttn(X_img, X_txt) = softmax(Q_img K_txt^T / sqrt(d_k)) V_txt, over n_heads heads of head_dim."""

    def __init__(
        self,
        query_dim: int,
        context_dim: int | None = None,
        n_heads: int = 8,
        head_dim: int = 64,
        qkv_bias: bool = False,
        backend: Backend | None = None,
    ) -> None:
        super().__init__()
        context_dim = context_dim or query_dim
        inner = n_heads * head_dim
        self.n_heads, self.head_dim = n_heads, head_dim
        self.to_q = nn.Linear(query_dim, inner, bias=qkv_bias)
        self.to_k = nn.Linear(context_dim, inner, bias=qkv_bias)
        self.to_v = nn.Linear(context_dim, inner, bias=qkv_bias)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim)])
        self.backend = backend or get_backend()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, N, D)

    def keys_values(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """context (B, M, context_dim) -> K, V, each (B, H, M, D)."""
        return self._heads(self.to_k(context)), self._heads(self.to_v(context))

    def forward(self, x: torch.Tensor, context: torch.Tensor | ContextCache | None = None) -> torch.Tensor:
        """x (B, N, query_dim), context (B, M, context_dim), its ContextCache, or None -> (B, N, query_dim)."""
        if isinstance(context, ContextCache):
            k, v = context.keys_values(self)
        else:
            k, v = self.keys_values(x if context is None else context)
        q = self._heads(self.to_q(x))
        o = self.backend.attend(q, k, v, causal=False, sm_scale=1.0 / math.sqrt(self.head_dim))
        b, _, n, _ = o.shape
        return self.to_out[0](o.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim))


class ContextCache:
    """A fixed context (B, M, context_dim) and, per CrossAttention layer that reads it, that layer's K and V: computed
    on the layer's first call and reused by every later one. Valid only while the weights stay as they are, so make
    one per inference call (e.g. per generated batch of images), never across training steps."""

    def __init__(self, context: torch.Tensor) -> None:
        self.context = context
        self._kv: dict[CrossAttention, tuple[torch.Tensor, torch.Tensor]] = {}

    def keys_values(self, attn: CrossAttention) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._kv.get(attn)
        if kv is None:
            kv = self._kv[attn] = attn.keys_values(self.context)
        return kv
