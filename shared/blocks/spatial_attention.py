"""Self-attention over the pixels of a feature map, with a GroupNorm in front and the input added back: the
mid-block attention of the Stable Diffusion autoencoder (Rombach et al. 2022, Appendix G; diffusers' Attention with
`group_norm` and `residual_connection`). One head of the full channel width at the lowest resolution.
"""

from __future__ import annotations

import torch
from torch import nn

from genserve.shared.blocks.cross_attention import CrossAttention
from genserve.shared.blocks.norms import group_norm


class SpatialSelfAttention(nn.Module):
    """x (B, C, H, W) -> x + Attn(GN x) over the H·W positions, heads of C / n_heads channels, biased projections."""

    def __init__(self, channels: int, groups: int = 32, n_heads: int = 1, eps: float = 1e-6) -> None:
        super().__init__()
        if channels % n_heads:
            raise ValueError(f"n_heads ({n_heads}) must divide channels ({channels})")
        self.group_norm = group_norm(channels, groups, eps)
        self.attn = CrossAttention(channels, None, n_heads, channels // n_heads, qkv_bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        tokens = self.group_norm(x).flatten(2).transpose(1, 2)  # (B, H*W, C)
        return x + self.attn(tokens).transpose(1, 2).reshape(b, c, h, w)
