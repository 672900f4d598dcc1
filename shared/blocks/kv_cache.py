"""Contiguous per-layer KV cache (Def. 16, "KV Cache", of the chapter "Deep Learning Building Blocks") and the KV-cache
memory calculator (Remark 11, "KV Cache Memory Budget"; the chapter's Exercise 13).

The serving engine uses a paged cache (services/text/engine, layout in docs/architecture.md); this contiguous one is
for single-request generation, tests and training-time sampling.
"""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values of one attention layer for up to `max_seq_len` positions: K_t = [K_{t-1}; k_t^T] (KV Cache).

    Buffers `k`, `v` are (B, Hkv, S_max, D); `length` counts the positions filled so far for the whole batch.
    """

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        n_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        v_head_dim = v_head_dim or head_dim
        self.register_buffer(
            "k", torch.zeros(batch_size, n_kv_heads, max_seq_len, head_dim, dtype=dtype, device=device)
        )
        self.register_buffer(
            "v", torch.zeros(batch_size, n_kv_heads, max_seq_len, v_head_dim, dtype=dtype, device=device)
        )
        self.length = 0

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, D) at positions length..length+T-1; return all cached keys/values so far."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(f"KV cache overflow: {end} positions > max_seq_len {self.max_seq_len}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # (B, Hkv, length, D)

    def reset(self) -> None:
        self.length = 0


def kv_cache_bytes(
    n_layers: int,
    seq_len: int,
    *,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    latent_dim: int | None = None,
    rope_dim: int = 0,
    batch_size: int = 1,
    bytes_per_value: int = 2,
) -> int:
    """Bytes held by a KV cache (Remark 11, "KV Cache Memory Budget"): 2 L h_kv d_k n values for MHA/GQA/MQA (keys
    and values, h_kv = h for MHA, G for GQA, 1 for MQA), or L (d_c + d_rope) n for MLA, which caches one latent and
    one decoupled RoPE key per token instead of per-head keys and values
    (Def. 22, "Multi-Head Latent Attention (MLA)"; Remark 17, "MLA in Practice"). Default 2 bytes per value (FP16).
    """
    if latent_dim is not None:
        if n_kv_heads is not None:
            raise ValueError("n_kv_heads: give either n_kv_heads/head_dim (MHA/GQA) or latent_dim (MLA), not both")
        per_token = latent_dim + rope_dim
    else:
        if n_kv_heads is None or head_dim is None:
            raise ValueError("n_kv_heads and head_dim are required without latent_dim")
        per_token = 2 * n_kv_heads * head_dim
    return n_layers * per_token * seq_len * batch_size * bytes_per_value
