"""Multi-head latent attention (Def. 22, "Multi-Head Latent Attention (MLA)", of the chapter
"Deep Learning Building Blocks") with decoupled RoPE (Remark 17, "MLA in Practice"), as in DeepSeek-V2.

Keys and values are rebuilt per head from a shared latent c_t^KV = W^DKV x_t (dim d_c << d). RoPE cannot pass
through that low-rank map, so each key also carries a small d_rope part k_t^R, rotated and shared by all heads,
next to the per-head non-rotated part. The cache (`LatentKVCache`) therefore stores only c_t^KV and k_t^R per token:
L (d_c + d_rope) values per token instead of 2 L h d_k.

Names follow DeepSeek-V2's checkpoints: `q_proj`, `kv_a_proj_with_mqa` (x -> [c_KV | k_R]), `kv_a_layernorm`,
`kv_b_proj` (c_KV -> per-head [k_nope | v], i.e. W^UK and W^UV stacked), `o_proj`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from genserve.shared.blocks.backend import Backend, get_backend
from genserve.shared.blocks.norms import RMSNorm


class LatentKVCache(nn.Module):
    """Contiguous MLA cache: `latent` (B, S_max, d_c) and `k_rope` (B, S_max, d_rope), nothing per head."""

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        latent_dim: int,
        rope_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("latent", torch.zeros(batch_size, max_seq_len, latent_dim, dtype=dtype, device=device))
        self.register_buffer("k_rope", torch.zeros(batch_size, max_seq_len, rope_dim, dtype=dtype, device=device))
        self.length = 0

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store latent (B, T, d_c) and k_rope (B, T, d_rope); return everything cached so far."""
        start, end = self.length, self.length + latent.shape[1]
        if end > self.latent.shape[1]:
            raise ValueError(f"MLA cache overflow: {end} positions > max_seq_len {self.latent.shape[1]}")
        self.latent[:, start:end] = latent
        self.k_rope[:, start:end] = k_rope
        self.length = end
        return self.latent[:, :end], self.k_rope[:, :end]


class MultiHeadLatentAttention(nn.Module):
    """MLA self-attention: x (B, T, dim) -> (B, T, dim)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        kv_latent_dim: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope_interleaved: bool = False,
        backend: Backend | None = None,
    ) -> None:
        super().__init__()
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {qk_rope_head_dim}")
        self.n_heads, self.kv_latent_dim = n_heads, kv_latent_dim
        self.d_nope, self.d_rope, self.d_v = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope_interleaved = rope_interleaved
        self.sm_scale = 1.0 / math.sqrt(qk_nope_head_dim + qk_rope_head_dim)
        self.q_proj = nn.Linear(dim, n_heads * (qk_nope_head_dim + qk_rope_head_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, kv_latent_dim + qk_rope_head_dim, bias=False)  # W^DKV and W^KR
        self.kv_a_layernorm = RMSNorm(kv_latent_dim, backend=backend)
        self.kv_b_proj = nn.Linear(kv_latent_dim, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)  # W^UK, W^UV
        self.o_proj = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.backend = backend or get_backend()

    def forward(
        self,
        x: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        positions: torch.Tensor | None = None,
        causal: bool = True,
        cache: LatentKVCache | None = None,
    ) -> torch.Tensor:
        """rope: (cos, sin) tables over d_rope; positions default to cache.length + 0..T-1."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.d_nope + self.d_rope).transpose(1, 2)  # (B, H, T, dn+dr)
        q_nope, q_rope = q.split((self.d_nope, self.d_rope), dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split((self.kv_latent_dim, self.d_rope), dim=-1)
        latent = self.kv_a_layernorm(latent)  # (B, T, d_c)
        if rope is not None:
            if positions is None:
                start = cache.length if cache is not None else 0
                positions = torch.arange(start, start + t, device=x.device)
            q_rope, k_rope = self.backend.apply_rope(
                q_rope, k_rope[:, None], rope[0], rope[1], positions, interleaved=self.rope_interleaved
            )
            k_rope = k_rope[:, 0]  # (B, T, d_rope), one rotated key part shared by every head
        if cache is not None:
            latent, k_rope = cache.append(latent, k_rope)
        n = latent.shape[1]
        kv = self.kv_b_proj(latent).view(b, n, self.n_heads, self.d_nope + self.d_v).transpose(1, 2)
        k_nope, v = kv.split((self.d_nope, self.d_v), dim=-1)  # (B, H, N, dn), (B, H, N, dv)
        k = torch.cat((k_nope, k_rope[:, None].expand(b, self.n_heads, n, self.d_rope)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        o = self.backend.attend(q, k, v, causal=causal, sm_scale=self.sm_scale)  # (B, H, T, dv)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.n_heads * self.d_v))
