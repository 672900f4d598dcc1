"""The prompt encoder: token embedding + learned positions + bidirectional pre-norm transformer blocks + final norm.

It is the small analogue of CLIP's text tower in Stable Diffusion, trained jointly with the U-Net from scratch; its
per-token outputs (B, T, dim) are the keys and values of the U-Net's cross-attention. Attention is not causal: every
token sees the whole caption, so "red" can bind to "circle" in either direction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from genserve.shared.blocks.positions import LearnedPositionalEmbedding
from genserve.shared.blocks.transformer import TransformerBlock, TransformerBlockConfig


@dataclass(frozen=True)
class TextEncoderConfig:
    vocab_size: int
    max_length: int = 12
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4

    def __post_init__(self) -> None:
        if self.vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4, got {self.vocab_size}")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if self.n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {self.n_layers}")
        if self.dim % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide dim ({self.dim})")


class TextEncoder(nn.Module):
    """ids (B, T) -> token features (B, T, dim)."""

    def __init__(self, config: TextEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.dim)
        self.position_embedding = LearnedPositionalEmbedding(config.dim, config.max_length)
        block = TransformerBlockConfig(dim=config.dim, n_heads=config.n_heads, block="pre_norm", norm="layernorm",
                                       ffn="gelu")
        self.layers = nn.ModuleList(TransformerBlock(block) for _ in range(config.n_layers))
        self.final_layer_norm = nn.LayerNorm(config.dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.position_embedding(self.token_embedding(ids))  # (B, T, dim)
        for layer in self.layers:
            x = layer(x, causal=False)
        return self.final_layer_norm(x)
