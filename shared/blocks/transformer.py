"""Transformer blocks, selected by `TransformerBlockConfig.block`:

- "post_norm": the original encoder block (Algorithm 2, "Transformer Encoder Block", of the chapter
  "Deep Learning Building Blocks"): h' = Norm(x + Attn(x)), h = Norm(h' + FFN(h'));
- "pre_norm": the modern decoder block (the chapter's table "Architectures for Generative Models"; Remark 9,
  "Pre-Norm vs. Post-Norm"): x += Attn(Norm(x)); x += FFN(Norm(x));
- "parallel": Def. 21 ("Parallel Transformer Block"): x' = x + Attn(Norm(x)) + FFN(Norm(x)), one norm shared by both
  branches.

Submodule names follow HF Llama (`input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`) so a Llama
checkpoint's layer maps 1:1 onto a pre-norm block with RMSNorm and SwiGLU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from genserve.shared.blocks.attention import MultiHeadAttention
from genserve.shared.blocks.backend import Backend
from genserve.shared.blocks.ffn import GeluFFN, SwiGLU
from genserve.shared.blocks.kv_cache import KVCache
from genserve.shared.blocks.moe import MoE
from genserve.shared.blocks.norms import norm

BlockKind = Literal["post_norm", "pre_norm", "parallel"]


@dataclass(frozen=True)
class TransformerBlockConfig:
    dim: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    # block structure
    block: BlockKind = "pre_norm"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-6
    # attention
    attn_bias: bool = False  # q/k/v bias (Qwen2, CLIP)
    attn_out_bias: bool = False  # output-projection bias (CLIP)
    gated_attention: bool = False  # Def. 18, "Gated Attention"
    rope_interleaved: bool = False
    # feedforward
    ffn: Literal["swiglu", "gelu", "moe"] = "swiglu"
    ffn_hidden_dim: int | None = None  # None: swiglu_hidden_dim(dim) or 4 dim for gelu
    ffn_act: str = "gelu"  # the "gelu" FFN's activation (activations.py), e.g. CLIP's "quick_gelu"
    n_experts: int = 0
    top_k: int = 0
    n_shared_experts: int = 0

    def __post_init__(self) -> None:
        if self.block not in ("post_norm", "pre_norm", "parallel"):
            raise ValueError(f"block must be 'post_norm', 'pre_norm' or 'parallel', got {self.block!r}")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {self.norm!r}")
        if self.ffn not in ("swiglu", "gelu", "moe"):
            raise ValueError(f"ffn must be 'swiglu', 'gelu' or 'moe', got {self.ffn!r}")
        if self.ffn == "moe" and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts] for ffn='moe', got {self.top_k} of {self.n_experts}")
        if self.dim <= 0 or self.n_heads <= 0:
            raise ValueError(f"dim ({self.dim}) and n_heads ({self.n_heads}) must be positive")


def _ffn(c: TransformerBlockConfig) -> nn.Module:
    if c.ffn == "swiglu":
        return SwiGLU(c.dim, c.ffn_hidden_dim)
    if c.ffn == "gelu":
        return GeluFFN(c.dim, c.ffn_hidden_dim, act=c.ffn_act)
    return MoE(c.dim, c.n_experts, c.top_k, c.ffn_hidden_dim, c.n_shared_experts)


class TransformerBlock(nn.Module):
    """x (B, T, dim) -> (B, T, dim); `forward` takes the attention's rope/positions/causal/kv_cache/attn_mask."""

    def __init__(self, config: TransformerBlockConfig, backend: Backend | None = None) -> None:
        super().__init__()
        c = self.config = config
        norm_kw = {"eps": c.norm_eps, "backend": backend} if c.norm == "rmsnorm" else {"eps": c.norm_eps}
        self.input_layernorm = norm(c.norm, c.dim, **norm_kw)
        self.self_attn = MultiHeadAttention(
            c.dim,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            bias=c.attn_bias,
            out_bias=c.attn_out_bias,
            gated=c.gated_attention,
            rope_interleaved=c.rope_interleaved,
            backend=backend,
        )
        # the parallel block feeds both branches from one norm (Def. 21, "Parallel Transformer Block"),
        # so it has no second norm
        self.post_attention_layernorm = norm(c.norm, c.dim, **norm_kw) if c.block != "parallel" else None
        self.mlp = _ffn(c)

    def forward(
        self,
        x: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        positions: torch.Tensor | None = None,
        causal: bool = True,
        kv_cache: KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        def attn(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(
                h, rope=rope, positions=positions, causal=causal, kv_cache=kv_cache, attn_mask=attn_mask
            )

        kind = self.config.block
        if kind == "post_norm":
            h = self.input_layernorm(x + attn(x))
            return self.post_attention_layernorm(h + self.mlp(h))
        if kind == "pre_norm":
            x = x + attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))
        h = self.input_layernorm(x)
        return x + attn(h) + self.mlp(h)
