"""CLIP's text transformer (Radford et al. 2021, §2.4), the prompt encoder of Stable Diffusion: token and learned
position embeddings, pre-norm blocks with causal self-attention (CLIP's text tower is a GPT-style decoder), and a
final LayerNorm. Its per-token outputs (B, T, dim) are the keys and values of the U-Net's cross-attention.

Built from the shared pre-norm `TransformerBlock` (LayerNorm, biased attention projections, a GELU-family FFN).
HF's CLIPTextModel names map onto it in services/diffusion/sd_text.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from genserve.shared.blocks.activations import ACTIVATION_NAMES
from genserve.shared.blocks.transformer import TransformerBlock, TransformerBlockConfig


@dataclass(frozen=True)
class CLIPTextConfig:
    vocab_size: int
    dim: int
    ffn_hidden_dim: int
    n_layers: int
    n_heads: int
    max_positions: int = 77
    act: str = "quick_gelu"  # "quick_gelu" (CLIP ViT-L, SD 1.x) or "gelu" (OpenCLIP ViT-H, SD 2.x)
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.dim, self.ffn_hidden_dim, self.n_layers, self.n_heads, self.max_positions) < 1:
            raise ValueError("vocab_size, dim, ffn_hidden_dim, n_layers, n_heads and max_positions must be >= 1")
        if self.dim % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide dim ({self.dim})")
        if self.act not in ACTIVATION_NAMES:
            raise ValueError(f"act must be one of {ACTIVATION_NAMES}, got {self.act!r}")


class CLIPTextTransformer(nn.Module):
    """ids (B, T) with T <= max_positions -> last hidden states (B, T, dim), after the final LayerNorm."""

    def __init__(self, config: CLIPTextConfig) -> None:
        super().__init__()
        self.config = c = config
        self.token_embedding = nn.Embedding(c.vocab_size, c.dim)
        self.position_embedding = nn.Embedding(c.max_positions, c.dim)
        block = TransformerBlockConfig(dim=c.dim, n_heads=c.n_heads, block="pre_norm", norm="layernorm",
                                       norm_eps=c.norm_eps, attn_bias=True, attn_out_bias=True, ffn="gelu",
                                       ffn_hidden_dim=c.ffn_hidden_dim, ffn_act=c.act)
        self.layers = nn.ModuleList(TransformerBlock(block) for _ in range(c.n_layers))
        self.final_layer_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.config.max_positions:
            raise ValueError(f"ids hold {t} tokens, more than max_positions ({self.config.max_positions})")
        positions = torch.arange(t, device=ids.device)
        x = self.token_embedding(ids) + self.position_embedding(positions)[None]  # (B, T, dim)
        for layer in self.layers:
            x = layer(x, causal=True)  # token i sees tokens 0..i
        return self.final_layer_norm(x)
