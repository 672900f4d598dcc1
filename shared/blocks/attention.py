"""Multi-head self-attention ("Multi-Head Attention", Def. 13 of the chapter "Deep Learning Building Blocks") with
grouped key/value heads (Def. 17, "Multi-Query and Grouped-Query Attention": MHA when n_kv_heads = n_heads, GQA in
between, MQA when n_kv_heads = 1), optional RoPE (Def. 15, "Rotary Position Embedding"), a KV cache (Def. 16,
"KV Cache") and the optional sigmoid output gate of gated attention (Def. 18, "Gated Attention").

Variants of the served families: QK-norm, a per-head RMSNorm of queries and keys before RoPE (`q_norm`, `k_norm`;
Qwen3, Gemma 3; Dehghani et al. 2023), logit soft-capping (`softcap`; Gemma 2) and learned attention sinks (`sinks`,
one logit per head; gpt-oss), the last two computed by the backend (sdpa.py).

Submodule names follow HF Llama/Qwen2 (`q_proj`, `k_proj`, `v_proj`, `o_proj`) so checkpoints map 1:1. The compute
goes through a backend (shared/blocks/backend.py); the module itself never looks at devices. `forward` attends over
dense (B, T) batches (training, parity, the image models); `forward_paged` over the serving engine's flat batch and
paged K/V cache (shared/blocks/paged.py). Both share the projections, RoPE, the gate and the output projection; only
the attention over keys differs: the backend's `attend` for dense and prefill rows, `paged_decode` for decode rows.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from genserve.shared.blocks.backend import Backend, get_backend
from genserve.shared.blocks.kv_cache import KVCache
from genserve.shared.blocks.linear import Linear
from genserve.shared.blocks.masks import causal_mask
from genserve.shared.blocks.norms import RMSNorm
from genserve.shared.blocks.paged import PagedBatch, PrefillChunk, gather
from genserve.shared.blocks.sdpa import scaled_dot_product_attention


class MultiHeadAttention(nn.Module):
    """MultiHead(X) = Concat(head_1..head_h) W^O, head_i = Attention(X W_i^Q, X W_g(i)^K, X W_g(i)^V).

    With `gated`, Y' = Y * sigmoid(X W_theta) is applied per head dimension to the concatenated heads before W^O
    (Def. 18, "Gated Attention"); W_theta is `gate_proj`.
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
        *,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        norm_unit_offset: bool = False,
        softcap: float = 0.0,
        sinks: bool = False,
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
        self.softcap = softcap
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, norm_eps, backend, unit_offset=norm_unit_offset)
            self.k_norm = RMSNorm(head_dim, norm_eps, backend, unit_offset=norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None

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
        t = x.shape[1]
        q, k, v = self._project(x)  # (B, Hq, T, D), (B, Hkv, T, D), (B, Hkv, T, D)
        if rope is not None:
            if positions is None:
                start = kv_cache.length if kv_cache is not None else 0
                positions = torch.arange(start, start + t, device=x.device)
            q, k = self.backend.apply_rope(q, k, rope[0], rope[1], positions, interleaved=self.rope_interleaved)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # (B, Hkv, Nk, D)
        if attn_mask is None:
            o = self.backend.attend(q, k, v, causal=causal, sm_scale=self.sm_scale, window=window,
                                    softcap=self.softcap, sinks=self.sinks)
        else:
            mask = attn_mask & causal_mask(t, k.shape[2], x.device) if causal else attn_mask
            o = scaled_dot_product_attention(q, k, v, mask, sm_scale=self.sm_scale, softcap=self.softcap,
                                             sinks=self.sinks)
        return self._output(o, x)

    def forward_paged(self, x: torch.Tensor, batch: PagedBatch, rope: tuple[torch.Tensor, torch.Tensor],
                      k_cache: torch.Tensor, v_cache: torch.Tensor, *, window: int = 0) -> torch.Tensor:
        """x (N, dim), the flat batch's tokens -> (N, dim). rope: (cos, sin) rows of each token's position (N, D/2).
        Writes every token's K/V into its cache slot, then attends: decode tokens over their sequences' cached keys
        (`paged_decode`), each prefill chunk over its own keys and, past its first chunk, the cached ones before it
        (bottom-right causal)."""
        q, k, v = (t[None] for t in self._project(x))  # (1, Hq, N, D), (1, Hkv, N, D), (1, Hkv, N, D)
        q, k = self.backend.apply_rope(q, k, *rope, None, interleaved=self.rope_interleaved)
        hkv, d = self.n_kv_heads, self.head_dim
        k_cache.view(-1, hkv, d).index_copy_(0, batch.slots, k[0].transpose(0, 1))  # (N, Hkv, D) into slots
        v_cache.view(-1, hkv, d).index_copy_(0, batch.slots, v[0].transpose(0, 1))
        out = torch.empty_like(q)  # (1, Hq, N, D)
        if batch.n_decode:
            qd = q[0, :, : batch.n_decode].transpose(0, 1)  # (Bd, Hq, D)
            od = self.backend.paged_decode(qd, k_cache, v_cache, batch.decode_tables, batch.decode_lens,
                                           sm_scale=self.sm_scale, window=window, softcap=self.softcap,
                                           sinks=self.sinks)
            out[0, :, : batch.n_decode] = od.transpose(0, 1)
        for c in batch.prefills:
            rows = slice(c.offset, c.offset + c.length)
            out[:, :, rows] = self._prefill(q[:, :, rows], k, v, c, k_cache, v_cache, window)
        return self._output(out[0], x)

    def _prefill(self, qc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: PrefillChunk, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, window: int) -> torch.Tensor:
        """One prefill chunk's queries (1, Hq, n, D) against its keys 0..context_len-1 (bottom-right causal)."""
        if c.start == 0:
            kc, vc = k[:, :, c.offset : c.offset + c.length], v[:, :, c.offset : c.offset + c.length]
        else:
            k_start = max(0, c.start - window + 1) if window else 0
            kc = gather(k_cache, c.table, k_start, c.context_len)
            vc = gather(v_cache, c.table, k_start, c.context_len)
        return self.backend.attend(qc, kc, vc, causal=True, sm_scale=self.sm_scale, window=window,
                                   softcap=self.softcap, sinks=self.sinks)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (..., T, dim) -> q (..., Hq, T, D), k and v (..., Hkv, T, D)."""
        q = self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim)).transpose(-3, -2)
        k = self.k_proj(x).unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(-3, -2)
        v = self.v_proj(x).unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(-3, -2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The heads o (..., Hq, T, D) concatenated (..., T, Hq*D), gated by x when gated, through W^O."""
        o = o.transpose(-3, -2).flatten(-2)
        if self.gate_proj is not None:
            o = o * torch.sigmoid(self.gate_proj(x))
        return self.o_proj(o)
