"""The decoder of every served text architecture (config.py), built from ``genserve.shared.blocks``: RMSNorm pre-norm
(Def. 19, "Root Mean Square Layer Normalisation"), RoPE (Def. 15, "Rotary Position Embedding") with the checkpoint's
theta and scaling, GQA (Def. 17, "Multi-Query and Grouped-Query Attention") or multi-head latent attention (Def. 22),
SwiGLU/GeGLU (Def. 20, "SwiGLU") or a mixture of experts (Remark 18), optional q/k/v bias, sliding windows per layer,
QK-norm, soft-capping, attention sinks, gated attention (Def. 18, "Gated Attention") and the parallel block (Def. 21,
"Parallel Transformer Block").

Parameter names are Hugging Face's (``model.layers.{i}.self_attn.q_proj.weight`` ...), so HF checkpoints load
1:1. Two forwards share the weights: ``forward`` over padded-free (B, T) batches for training and tests, and
``forward_paged`` over the engine's flat multi-sequence batch against the paged KV cache.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from genserve.services.text.config import LlamaConfig
from genserve.services.text.quantize import Int8Linear
from genserve.shared.blocks.attention import MultiHeadAttention
from genserve.shared.blocks.backend import Backend, get_backend
from genserve.shared.blocks.ffn import SwiGLU
from genserve.shared.blocks.linear import Linear
from genserve.shared.blocks.mla import MultiHeadLatentAttention
from genserve.shared.blocks.moe import MoE
from genserve.shared.blocks.norms import RMSNorm
from genserve.shared.blocks.paged import PagedBatch
from genserve.shared.blocks.quant_linear import QuantLinear
from genserve.shared.blocks.rope import RoPE, RopeScaling


class DecoderLayer(nn.Module):
    """x' = x + Attn(Norm(x)); x'' = x' + FFN(Norm(x')) — or, with ``parallel_block``, the single-norm parallel
    form x' = x + Attn(Norm(x)) + FFN(Norm(x)) (Def. 21, "Parallel Transformer Block"); with ``sandwich_norm``
    (Gemma 2/3) each sublayer's output is normalised too: x' = x + Norm(Attn(Norm(x))), x'' = x' + Norm(FFN(Norm(x'))).

    As in vLLM, the residual stream travels beside the layer's output so that every add lands in the following
    norm (``RMSNorm(x, residual)``, one fused pass on the GPU): a layer takes (its input's last delta, the residual
    before it) and returns (its own delta, the residual before that delta); the first layer gets (embedding, None).
    """

    def __init__(self, cfg: LlamaConfig, backend: Backend, index: int = 0):
        super().__init__()
        self.cfg = cfg
        self.window = cfg.layer_window(index)
        self.local_rope = bool(self.window and cfg.rope_local_theta)  # Gemma 3's sliding layers have their own base

        def norm(dim: int = cfg.dim) -> RMSNorm:
            return RMSNorm(dim, cfg.norm_eps, backend, unit_offset=cfg.norm_unit_offset)

        self.input_layernorm = norm()
        self.self_attn = _attention(cfg, backend)
        self.post_attention_layernorm = None if cfg.parallel_block else norm()
        if cfg.sandwich_norm:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = _ffn(cfg, backend, index)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, attend) -> tuple[torch.Tensor, torch.Tensor]:
        """``attend(self_attn, h) -> attention output`` supplies the attention for either forward path."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)  # residual = x + residual, h = Norm(residual)
        if self.post_attention_layernorm is None:
            return attend(self.self_attn, h) + self.mlp(h), residual
        if self.cfg.sandwich_norm:
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(attend(self.self_attn, h)),
                                                         residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(attend(self.self_attn, h), residual)
        return self.mlp(h), residual


def _sm_scale(cfg: LlamaConfig) -> float:
    """The softmax scale: 1/sqrt(head width), Gemma's query_pre_attn_scalar, and for MLA with YaRN the square of
    YaRN's mscale (DeepSeek-V2's reference code scales every score dimension, not only the rotated ones)."""
    if cfg.query_pre_attn_scalar:
        return 1.0 / math.sqrt(cfg.query_pre_attn_scalar)
    scale = 1.0 / math.sqrt(cfg.head_dim)  # as the attention block computes its default, to the last bit
    scaling = dict(cfg.rope_scaling)
    if cfg.mla and cfg.rope_type == "yarn" and scaling.get("mscale_all_dim") and scaling.get("factor", 1) > 1:
        mscale = 0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


def _attention(cfg: LlamaConfig, backend: Backend) -> nn.Module:
    if cfg.mla:
        return MultiHeadLatentAttention(cfg.dim, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                                        cfg.qk_rope_head_dim, cfg.v_head_dim, rope_interleaved=cfg.rope_interleaved,
                                        backend=backend, q_lora_rank=cfg.q_lora_rank, sm_scale=_sm_scale(cfg),
                                        norm_eps=cfg.norm_eps)
    return MultiHeadAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, bias=cfg.qkv_bias,
                              out_bias=cfg.o_bias, gated=cfg.gated_attention, sm_scale=_sm_scale(cfg), backend=backend,
                              qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps, norm_unit_offset=cfg.norm_unit_offset,
                              softcap=cfg.attn_softcap, sinks=cfg.attention_sinks)


def _ffn(cfg: LlamaConfig, backend: Backend, index: int) -> nn.Module:
    act = {"activation": cfg.hidden_act, "alpha": cfg.swiglu_alpha, "limit": cfg.swiglu_limit}
    if cfg.layer_is_moe(index):
        hidden = cfg.moe_hidden or cfg.ffn_hidden
        return MoE(cfg.dim, n_experts=cfg.n_experts, top_k=cfg.n_experts_per_token, hidden_dim=hidden,
                   n_shared_experts=1 if cfg.n_shared_experts else 0, normalize_topk=cfg.norm_topk_prob,
                   router=cfg.router, router_bias=cfg.router_bias, expert_bias=cfg.expert_bias,
                   shared_hidden_dim=hidden * cfg.n_shared_experts or None, n_groups=cfg.n_expert_groups,
                   topk_groups=cfg.topk_groups, routed_scaling=cfg.routed_scaling, backend=backend, **act)
    return SwiGLU(cfg.dim, cfg.ffn_hidden, backend=backend, **act)


class TokenEmbedding(nn.Embedding):
    """nn.Embedding without its random init on the meta device, where the loader builds the model before assigning
    the checkpoint's tensors: torch's meta ``normal_`` (a torch._refs decomposition) imports torch._dynamo on first
    use, about 2 s of every text replica's start that nothing else needs."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Backbone(nn.Module):
    """Embedding, decoder layers and the final norm (HF's ``model.*`` prefix)."""

    def __init__(self, cfg: LlamaConfig, backend: Backend):
        super().__init__()
        self.embed_tokens = TokenEmbedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, backend, unit_offset=cfg.norm_unit_offset)
        self.embed_scale = cfg.dim ** 0.5 if cfg.embed_scale else 0.0

    def forward(self, input_ids: torch.Tensor, attend, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (...) -> final hidden states (..., dim); ``rows`` keeps only those tokens (flat index) before
        the final norm, where only some tokens need logits."""
        x, residual = self.embed_tokens(input_ids), None
        if self.embed_scale:  # Gemma: the scale rounded to the activations' dtype first, as its reference does
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, lambda attn, h, i=i: attend(i, attn, h))
        if rows is not None:
            x, residual = x[rows], residual[rows]
        return self.norm(x, residual)[0]


def make_rope(cfg: LlamaConfig) -> RoPE:
    """cos/sin tables for positions 0..max_position-1 with the checkpoint's theta and scaling
    (Remark 10, "RoPE in Practice"); the rotated width is MLA's decoupled part where it applies."""
    return RoPE(cfg.rope_dim, cfg.max_position, cfg.rope_theta,
                RopeScaling.from_hf(dict(cfg.rope_scaling), cfg.max_position))


def make_local_rope(cfg: LlamaConfig) -> RoPE | None:
    """The sliding layers' tables where they have a base of their own (Gemma 3), unscaled; None otherwise."""
    return RoPE(cfg.rope_dim, cfg.max_position, cfg.rope_local_theta) if cfg.rope_local_theta else None


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: Backend | None = None, rope: RoPE | None = None,
                 local_rope: RoPE | None = None):
        """``rope``, ``local_rope``: tables already made (the loader builds the rest on the meta device, where they
        cannot be)."""
        super().__init__()
        self.config = cfg
        self.backend = backend or get_backend()
        self.model = Backbone(cfg, self.backend)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False, backend=self.backend)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = make_rope(cfg) if rope is None else rope
        self.local_rope = make_local_rope(cfg) if local_rope is None else local_rope
        self.final_softcap = cfg.final_softcap

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> logits, soft-capped where the model caps them (Gemma 2)."""
        logits = self.lm_head(h)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _tables(self, layer: DecoderLayer) -> tuple[torch.Tensor, torch.Tensor]:
        return self.local_rope.tables() if layer.local_rope else self.rope.tables()

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
        long = 0 < self.rope.long_prompt_from < input_ids.shape[1]  # longrope past the original context (rope.py)

        def attend(i: int, attn: nn.Module, h: torch.Tensor) -> torch.Tensor:
            layer = self.model.layers[i]
            rope = self.rope.long_tables() if long and not layer.local_rope else self._tables(layer)
            if isinstance(attn, MultiHeadLatentAttention):
                return attn(h, rope=rope, positions=positions)
            return attn(h, rope=rope, positions=positions, window=layer.window)

        return self.logits(self.model(input_ids, attend))  # (B, T, V)

    # ---- the engine's flat batch against the paged cache ------------------------------------------------------
    def forward_paged(self, batch: PagedBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]
                      ) -> torch.Tensor:
        """Compute every token of ``batch``, writing its K/V into the caches (one per layer, paged layout);
        returns next-token logits (S, V) for the tokens in ``batch.logits_index``."""
        batch = batch.to(self.model.embed_tokens.weight.device)
        cos, sin = self.rope.tables()
        rope = cos[batch.positions], sin[batch.positions]  # (N, D/2): one row per token, gathered once per step
        if batch.long_rope is not None and self.rope.long_prompt_from:  # prompts past longrope's original context
            long = batch.long_rope[:, None]
            long_cos, long_sin = self.rope.long_tables()
            rope = (torch.where(long, long_cos[batch.positions], rope[0]),
                    torch.where(long, long_sin[batch.positions], rope[1]))
        if self.local_rope is not None:
            cos, sin = self.local_rope.tables()
            local = cos[batch.positions], sin[batch.positions]

        views = batch.layer_views(len(self.model.layers))  # each layer's KV group's slots and tables

        def attend(i: int, attn: nn.Module, h: torch.Tensor) -> torch.Tensor:
            layer = self.model.layers[i]
            rows = local if layer.local_rope else rope
            if isinstance(attn, MultiHeadLatentAttention):  # one cache serves as keys and values (mla.py)
                return attn.forward_paged(h, views[i], rows, k_caches[i], window=layer.window)
            return attn.forward_paged(h, views[i], rows, k_caches[i], v_caches[i], window=layer.window)

        # (S, dim): the final norm and the LM head only where a token is sampled
        return self.logits(self.model(batch.input_ids, attend, rows=batch.logits_index))
