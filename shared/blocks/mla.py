"""Multi-head latent attention (Def. 22, "Multi-Head Latent Attention (MLA)", of the chapter
"Deep Learning Building Blocks") with decoupled RoPE (Remark 17, "MLA in Practice"), as in DeepSeek-V2.

Keys and values are rebuilt per head from a shared latent c_t^KV = W^DKV x_t (dim d_c << d). RoPE cannot pass
through that low-rank map, so each key also carries a small d_rope part k_t^R, rotated and shared by all heads,
next to the per-head non-rotated part. The cache (`LatentKVCache`) therefore stores only c_t^KV and k_t^R per token:
L (d_c + d_rope) values per token instead of 2 L h d_k.

Serving uses the absorbed form (DeepSeek-V2, section 2.1.2; vLLM's MLA backend): q_nope^T k_nope = (W^UK^T q_nope)^T
c_KV, so each head's query is moved into the latent space once and attends straight over the cached [c_KV | k_R];
the values are the latent itself, and W^UV is applied to each head's attended latent afterwards. That makes the
paged cache one "head" of d_c + d_rope values per token and decode attention MQA over it, run by the backend's
`mla_decode` (Triton: kernels/mla_decode.py, which reads each entry once for the scores and the values). Prefill
expands instead (vLLM and SGLang do the same): its context's latents go through W^UK and W^UV once per chunk, and the
chunk attends per head with dn + d_rope wide keys, fewer products per score than d_c + d_rope when T is large.

Names follow DeepSeek-V2/V3's checkpoints: `q_proj` (or, with a query LoRA rank, `q_a_proj`, `q_a_layernorm`,
`q_b_proj`), `kv_a_proj_with_mqa` (x -> [c_KV | k_R]), `kv_a_layernorm`, `kv_b_proj` (c_KV -> per-head [k_nope | v],
i.e. W^UK and W^UV stacked), `o_proj`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from genserve.shared.blocks.backend import Backend, get_backend
from genserve.shared.blocks.norms import RMSNorm
from genserve.shared.blocks.paged import PagedBatch, gather


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
        *,
        q_lora_rank: int = 0,
        sm_scale: float | None = None,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {qk_rope_head_dim}")
        self.n_heads, self.kv_latent_dim = n_heads, kv_latent_dim
        self.d_nope, self.d_rope, self.d_v = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope_interleaved = rope_interleaved
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(qk_nope_head_dim + qk_rope_head_dim)
        q_out = n_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank:  # DeepSeek-V2/V3 compress the query too: W^UQ (norm (W^DQ x))
            self.q_a_proj = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps, backend=backend)
            self.q_b_proj = nn.Linear(q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(dim, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, kv_latent_dim + qk_rope_head_dim, bias=False)  # W^DKV and W^KR
        self.kv_a_layernorm = RMSNorm(kv_latent_dim, norm_eps, backend=backend)
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
        q = self._query(x).view(b, t, self.n_heads, self.d_nope + self.d_rope).transpose(1, 2)  # (B, H, T, dn+dr)
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
        o = self._attend_expanded(q_nope, q_rope, latent, k_rope, causal=causal)  # (B, H, T, dv)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.n_heads * self.d_v))

    def _attend_expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                         k_rope: torch.Tensor, *, causal: bool, window: int = 0) -> torch.Tensor:
        """Queries q_nope (B, H, T, dn) and q_rope (B, H, T, dr) over per-head keys [W^UK c | k_R] and values W^UV c,
        rebuilt from S latents (B, S, d_c) and rotated key parts (B, S, dr) -> (B, H, T, dv)."""
        b, s = latent.shape[:2]
        kv = self.kv_b_proj(latent).view(b, s, self.n_heads, self.d_nope + self.d_v).transpose(1, 2)
        k_nope, v = kv.split((self.d_nope, self.d_v), dim=-1)  # (B, H, S, dn), (B, H, S, dv)
        k = torch.cat((k_nope, k_rope[:, None].expand(b, self.n_heads, s, self.d_rope)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return self.backend.attend(q, k, v, causal=causal, sm_scale=self.sm_scale, window=window)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., dim) -> every head's query (..., H (dn + dr))."""
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W^UK (H, dn, d_c) and W^UV (H, dv, d_c), views of `kv_b_proj`."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.d_nope + self.d_v, self.kv_latent_dim)
        return w[:, : self.d_nope], w[:, self.d_nope :]

    def forward_paged(self, x: torch.Tensor, batch: PagedBatch, rope: tuple[torch.Tensor, torch.Tensor],
                      cache: torch.Tensor, *, window: int = 0) -> torch.Tensor:
        """The engine's flat batch x (N, dim) -> (N, dim). `cache` (num_blocks, block_size, 1, d_c + dr) holds every
        token's entry [norm(c_KV) | RoPE(k_R)]. Decode rows attend in the absorbed form (module docstring), through
        the backend's `mla_decode`; prefill chunks expand their context's latents into per-head keys and values, as
        the dense forward does, where each score costs dn + dr products instead of d_c + dr."""
        n = x.shape[0]
        q = self._query(x).view(n, self.n_heads, self.d_nope + self.d_rope)
        q_nope, q_rope = q.split((self.d_nope, self.d_rope), dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split((self.kv_latent_dim, self.d_rope), dim=-1)
        latent = self.kv_a_layernorm(latent)  # (N, d_c)
        q_rope, k_rope = self.backend.apply_rope(q_rope.transpose(0, 1)[None], k_rope[None, None], rope[0], rope[1],
                                                 None, interleaved=self.rope_interleaved)
        q_rope, k_rope = q_rope[0].transpose(0, 1), k_rope[0, 0]  # (N, H, dr), (N, dr)
        entries = torch.cat((latent, k_rope), dim=-1)  # (N, d_c + dr)
        cache.view(-1, entries.shape[-1]).index_copy_(0, batch.slots, entries)
        out = x.new_empty(n, self.n_heads, self.d_v)
        if batch.n_decode:
            rows = slice(0, batch.n_decode)
            w_uk, w_uv = self._up()
            absorbed = torch.cat((torch.einsum("nhd,hdc->nhc", q_nope[rows], w_uk), q_rope[rows]), dim=-1)
            o = self.backend.mla_decode(absorbed, cache, batch.decode_tables, batch.decode_lens,
                                        latent_dim=self.kv_latent_dim, sm_scale=self.sm_scale, window=window)
            out[rows] = torch.einsum("nhc,hvc->nhv", o, w_uv)  # W^UV on each head's attended latent
        for c in batch.prefills:
            rows = slice(c.offset, c.offset + c.length)
            if c.start == 0:
                context = entries[rows]
            else:
                first = max(0, c.start - window + 1) if window else 0
                context = gather(cache, c.table, first, c.context_len)[0, 0]  # (keys, d_c + dr)
            latent, k_rope = context[None].split((self.kv_latent_dim, self.d_rope), dim=-1)  # (1, S, d_c), (1, S, dr)
            o = self._attend_expanded(q_nope[rows].transpose(0, 1)[None], q_rope[rows].transpose(0, 1)[None], latent,
                                      k_rope, causal=True, window=window)  # (1, H, T, dv): the chunk's T queries
            out[rows] = o[0].transpose(0, 1)
        return self.o_proj(out.flatten(1))
