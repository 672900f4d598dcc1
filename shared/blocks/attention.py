"""Multi-head self-attention (seed Def. 13) with grouped key/value heads (Def. 17: MHA when n_kv_heads = n_heads,
GQA in between, MQA when n_kv_heads = 1), optional RoPE (Def. 15), a KV cache (Def. 16) and the optional sigmoid
output gate of gated attention (Def. 18).

Submodule names follow HF Llama/Qwen2 (`q_proj`, `k_proj`, `v_proj`, `o_proj`) so checkpoints map 1:1. The compute
goes through a backend (shared/blocks/backend.py); the module itself never looks at devices.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shared.blocks.backend import Backend, get_backend
from shared.blocks.kv_cache import KVCache
from shared.blocks.linear import Linear
from shared.blocks.masks import causal_mask
from shared.blocks.sdpa import scaled_dot_product_attention


class MultiHeadAttention(nn.Module):
    """MultiHead(X) = Concat(head_1..head_h) W^O, head_i = Attention(X W_i^Q, X W_g(i)^K, X W_g(i)^V).

    With `gated`, Y' = Y * sigmoid(X W_theta) is applied per head dimension to the concatenated heads before W^O
    (Def. 18); W_theta is `gate_proj`.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = False,
        out_bias: bool = False,
        gated: bool = False,
        rope_interleaved: bool = False,
        sm_scale: float | None = None,
        backend: Backend | None = None,
    ) -> None:
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if n_heads <= 0 or n_kv_heads <= 0:
            raise ValueError(f"n_heads ({n_heads}) and n_kv_heads ({n_kv_heads}) must be positive")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
        if head_dim is None:
            if dim % n_heads:
                raise ValueError(f"head_dim: dim ({dim}) is not divisible by n_heads ({n_heads}); give head_dim")
            head_dim = dim // n_heads
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rope_interleaved = rope_interleaved
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self.backend = backend = backend or get_backend()
        self.q_proj = Linear(dim, n_heads * head_dim, bias=bias, backend=backend)
        self.k_proj = Linear(dim, n_kv_heads * head_dim, bias=bias, backend=backend)
        self.v_proj = Linear(dim, n_kv_heads * head_dim, bias=bias, backend=backend)
        self.o_proj = Linear(n_heads * head_dim, dim, bias=out_bias, backend=backend)
        self.gate_proj = Linear(dim, n_heads * head_dim, bias=False, backend=backend) if gated else None

    def forward(
        self,
        x: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        positions: torch.Tensor | None = None,
        causal: bool = True,
        kv_cache: KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim).

        rope: (cos, sin) tables (P, D/2); positions default to cache.length + 0..T-1. kv_cache: new keys/values
        are appended and attention runs over everything cached. attn_mask: bool keep-mask broadcastable to
        (B, H, T, Nk), combined with the causal mask when `causal`; it routes through the written-out attention.
        window: a sliding attention window (causal only), passed to the backend.
        """
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            if positions is None:
                start = kv_cache.length if kv_cache is not None else 0
                positions = torch.arange(start, start + t, device=x.device)
            q, k = self.backend.apply_rope(q, k, rope[0], rope[1], positions, interleaved=self.rope_interleaved)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # (B, Hkv, Nk, D)
        if attn_mask is None:
            o = self.backend.attend(q, k, v, causal=causal, sm_scale=self.sm_scale, window=window)
        else:
            mask = attn_mask & causal_mask(t, k.shape[2], x.device) if causal else attn_mask
            o = scaled_dot_product_attention(q, k, v, mask, sm_scale=self.sm_scale)
        o = o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (B, T, Hq*D)
        if self.gate_proj is not None:
            o = o * torch.sigmoid(self.gate_proj(x))
        return self.o_proj(o)
