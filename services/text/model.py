"""The Llama-family decoder (Llama, Mistral, Qwen2, and our own models with the seed's options), built from
``shared.blocks``: RMSNorm pre-norm (Def. 19), RoPE (Def. 15) with the checkpoint's theta and scaling, GQA
(Def. 17), SwiGLU (Def. 20), optional q/k/v bias, sliding-window attention, gated attention (Def. 18) and the
parallel block (Def. 21).

Parameter names are Hugging Face's (``model.layers.{i}.self_attn.q_proj.weight`` ...), so HF checkpoints load
1:1. Two forwards share the weights: ``forward`` over padded-free (B, T) batches for training and tests, and
``forward_paged`` over the engine's flat multi-sequence batch against the paged KV cache.
"""

from __future__ import annotations

import torch
from torch import nn

from services.text.config import LlamaConfig
from services.text.paged import PagedBatch, PrefillChunk
from services.text.quantize import Int8Linear
from shared.blocks.attention import MultiHeadAttention
from shared.blocks.backend import Backend, get_backend
from shared.blocks.ffn import SwiGLU
from shared.blocks.linear import Linear
from shared.blocks.norms import RMSNorm
from shared.blocks.quant_linear import QuantLinear
from shared.blocks.rope import RoPE, RopeScaling


class DecoderLayer(nn.Module):
    """x' = x + Attn(Norm(x)); x'' = x' + FFN(Norm(x')) — or, with ``parallel_block``, the single-norm parallel
    form x' = x + Attn(Norm(x)) + FFN(Norm(x)) (Def. 21).

    As in vLLM, the residual stream travels beside the layer's output so that every add lands in the following
    norm (``RMSNorm(x, residual)``, one fused pass on the GPU): a layer takes (its input's last delta, the residual
    before it) and returns (its own delta, the residual before that delta); the first layer gets (embedding, None).
    """

    def __init__(self, cfg: LlamaConfig, backend: Backend):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, backend)
        self.self_attn = MultiHeadAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, bias=cfg.qkv_bias,
                                            gated=cfg.gated_attention, backend=backend)
        self.post_attention_layernorm = None if cfg.parallel_block else RMSNorm(cfg.dim, cfg.norm_eps, backend)
        self.mlp = _ffn(cfg, backend)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, attend) -> tuple[torch.Tensor, torch.Tensor]:
        """``attend(self_attn, h) -> attention output`` supplies the attention for either forward path."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)  # residual = x + residual, h = Norm(residual)
        if self.post_attention_layernorm is None:
            return attend(self.self_attn, h) + self.mlp(h), residual
        h, residual = self.post_attention_layernorm(attend(self.self_attn, h), residual)
        return self.mlp(h), residual


def _ffn(cfg: LlamaConfig, backend: Backend) -> nn.Module:
    if cfg.n_experts:
        from shared.blocks.moe import MoE

        return MoE(cfg.dim, n_experts=cfg.n_experts, top_k=cfg.n_experts_per_token, hidden_dim=cfg.ffn_hidden)
    return SwiGLU(cfg.dim, cfg.ffn_hidden, backend=backend)


class Backbone(nn.Module):
    """Embedding, decoder layers and the final norm (HF's ``model.*`` prefix)."""

    def __init__(self, cfg: LlamaConfig, backend: Backend):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, backend)

    def forward(self, input_ids: torch.Tensor, attend, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (...) -> final hidden states (..., dim); ``rows`` keeps only those tokens (flat index) before
        the final norm, where only some tokens need logits."""
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, lambda attn, h, i=i: attend(i, attn, h))
        if rows is not None:
            x, residual = x[rows], residual[rows]
        return self.norm(x, residual)[0]


def make_rope(cfg: LlamaConfig) -> RoPE:
    """cos/sin tables for positions 0..max_position-1 with the checkpoint's theta and scaling (Remark 10)."""
    return RoPE(cfg.head_dim, cfg.max_position, cfg.rope_theta,
                RopeScaling.from_hf(dict(cfg.rope_scaling), cfg.max_position))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: Backend | None = None):
        super().__init__()
        self.config = cfg
        self.backend = backend or get_backend()
        self.model = Backbone(cfg, self.backend)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False, backend=self.backend)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = make_rope(cfg)

    def num_params(self) -> int:
        """Parameters of the checkpoint: tied weights once; int8- and GGUF-quantised matrices (buffers) included."""
        quantized = sum(m.weight.numel() for m in self.modules() if isinstance(m, Int8Linear))
        quantized += sum(m.in_features * m.out_features for m in self.modules() if isinstance(m, QuantLinear))
        tied_copy = self.config.tie_embeddings and isinstance(self.lm_head, Int8Linear | QuantLinear)
        return sum(p.numel() for p in self.parameters()) + quantized - (
            self.lm_head.in_features * self.lm_head.out_features if tied_copy else 0)

    # ---- (B, T) batches: training, parity tests ---------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, V), every sequence starting at position 0."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)

        def attend(i: int, attn: MultiHeadAttention, h: torch.Tensor) -> torch.Tensor:
            return attn(h, rope=self.rope.tables(), positions=positions, window=self.config.sliding_window)

        return self.lm_head(self.model(input_ids, attend))  # (B, T, V)

    # ---- the engine's flat batch against the paged cache ------------------------------------------------------
    def forward_paged(self, batch: PagedBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]
                      ) -> torch.Tensor:
        """Compute every token of ``batch``, writing its K/V into the caches (one per layer, paged layout);
        returns next-token logits (S, V) for the tokens in ``batch.logits_index``."""
        batch = batch.to(self.model.embed_tokens.weight.device)
        cos, sin = self.rope.tables()
        rope = cos[batch.positions], sin[batch.positions]  # (N, D/2): one row per token, gathered once per step

        def attend(i: int, attn: MultiHeadAttention, h: torch.Tensor) -> torch.Tensor:
            return self._paged_attention(attn, h, batch, rope, k_caches[i], v_caches[i])

        # (S, dim): the final norm and the LM head only where a token is sampled
        return self.lm_head(self.model(batch.input_ids, attend, rows=batch.logits_index))

    def _paged_attention(self, attn: MultiHeadAttention, h: torch.Tensor, batch: PagedBatch,
                         rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor
                         ) -> torch.Tensor:
        n = h.shape[0]
        hq, hkv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
        q = attn.q_proj(h).view(n, hq, d).transpose(0, 1)[None]  # (1, Hq, N, D)
        k = attn.k_proj(h).view(n, hkv, d).transpose(0, 1)[None]  # (1, Hkv, N, D)
        v = attn.v_proj(h).view(n, hkv, d).transpose(0, 1)[None]
        q, k = attn.backend.apply_rope(q, k, *rope, None, interleaved=attn.rope_interleaved)
        k_cache.view(-1, hkv, d).index_copy_(0, batch.slots, k[0].transpose(0, 1))  # (N, Hkv, D) into slots
        v_cache.view(-1, hkv, d).index_copy_(0, batch.slots, v[0].transpose(0, 1))
        out = torch.empty_like(q)  # (1, Hq, N, D)
        if batch.n_decode:
            qd = q[0, :, : batch.n_decode].transpose(0, 1)  # (Bd, Hq, D)
            od = attn.backend.paged_decode(qd, k_cache, v_cache, batch.decode_tables, batch.decode_lens,
                                           sm_scale=attn.sm_scale, window=self.config.sliding_window)
            out[0, :, : batch.n_decode] = od.transpose(0, 1)
        for c in batch.prefills:
            qc = q[:, :, c.offset : c.offset + c.length]  # (1, Hq, n, D)
            out[:, :, c.offset : c.offset + c.length] = self._prefill_attention(attn, qc, k, v, c, k_cache, v_cache)
        o = out[0].transpose(0, 1).reshape(n, hq * d)  # (N, Hq*D)
        if attn.gate_proj is not None:
            o = o * torch.sigmoid(attn.gate_proj(h))
        return attn.o_proj(o)

    def _prefill_attention(self, attn: MultiHeadAttention, qc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           c: PrefillChunk, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """One prefill chunk's queries (1, Hq, n, D) against its keys 0..context_len-1 (bottom-right causal)."""
        window = self.config.sliding_window
        if c.start == 0:
            kc, vc = k[:, :, c.offset : c.offset + c.length], v[:, :, c.offset : c.offset + c.length]
            k_start = 0
        else:
            k_start = max(0, c.start - window + 1) if window else 0
            bs = k_cache.shape[1]
            kc = _gather(k_cache, c.table, k_start, c.context_len, bs)
            vc = _gather(v_cache, c.table, k_start, c.context_len, bs)
        return attn.backend.attend(qc, kc, vc, causal=True, sm_scale=attn.sm_scale, window=window)


def _gather(cache: torch.Tensor, table: torch.Tensor, start: int, end: int, block_size: int) -> torch.Tensor:
    """Positions start..end-1 of one sequence out of a paged cache -> (1, Hkv, end-start, D)."""
    pos = torch.arange(start, end, device=cache.device)
    slots = table[pos // block_size] * block_size + pos % block_size
    return cache.view(-1, cache.shape[2], cache.shape[3])[slots].transpose(0, 1)[None]
