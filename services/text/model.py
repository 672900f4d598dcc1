"""The Llama-family decoder (Llama, Mistral, Qwen2, and our own models with the options of the chapter
"Deep Learning Building Blocks"), built from ``genserve.shared.blocks``: RMSNorm pre-norm (Def. 19,
"Root Mean Square Layer Normalisation"), RoPE (Def. 15, "Rotary Position Embedding") with the checkpoint's theta and
scaling, GQA (Def. 17, "Multi-Query and Grouped-Query Attention"), SwiGLU (Def. 20, "SwiGLU"), optional q/k/v bias,
sliding-window attention, gated attention (Def. 18, "Gated Attention") and the parallel block (Def. 21,
"Parallel Transformer Block").

Parameter names are Hugging Face's (``model.layers.{i}.self_attn.q_proj.weight`` ...), so HF checkpoints load
1:1. Two forwards share the weights: ``forward`` over padded-free (B, T) batches for training and tests, and
``forward_paged`` over the engine's flat multi-sequence batch against the paged KV cache.
"""

from __future__ import annotations

import torch
from torch import nn

from genserve.services.text.config import LlamaConfig
from genserve.services.text.quantize import Int8Linear
from genserve.shared.blocks.attention import MultiHeadAttention
from genserve.shared.blocks.backend import Backend, get_backend
from genserve.shared.blocks.ffn import SwiGLU
from genserve.shared.blocks.linear import Linear
from genserve.shared.blocks.norms import RMSNorm
from genserve.shared.blocks.paged import PagedBatch
from genserve.shared.blocks.quant_linear import QuantLinear
from genserve.shared.blocks.rope import RoPE, RopeScaling


class DecoderLayer(nn.Module):
    """x' = x + Attn(Norm(x)); x'' = x' + FFN(Norm(x')) — or, with ``parallel_block``, the single-norm parallel
    form x' = x + Attn(Norm(x)) + FFN(Norm(x)) (Def. 21, "Parallel Transformer Block").

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
        from genserve.shared.blocks.moe import MoE

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
    """cos/sin tables for positions 0..max_position-1 with the checkpoint's theta and scaling
    (Remark 10, "RoPE in Practice")."""
    return RoPE(cfg.head_dim, cfg.max_position, cfg.rope_theta,
                RopeScaling.from_hf(dict(cfg.rope_scaling), cfg.max_position))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: Backend | None = None, rope: RoPE | None = None):
        """``rope``: tables already made (the loader builds the rest on the meta device, where they cannot be)."""
        super().__init__()
        self.config = cfg
        self.backend = backend or get_backend()
        self.model = Backbone(cfg, self.backend)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False, backend=self.backend)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = make_rope(cfg) if rope is None else rope

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
            return attn.forward_paged(h, batch, rope, k_caches[i], v_caches[i], window=self.config.sliding_window)

        # (S, dim): the final norm and the LM head only where a token is sampled
        return self.lm_head(self.model(batch.input_ids, attend, rows=batch.logits_index))
