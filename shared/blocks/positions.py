"""Absolute position and timestep embeddings: sinusoidal (Def. 14, "Sinusoidal Positional Encoding", of the chapter
"Deep Learning Building Blocks"), learned (Remark 8, "Learnable vs. Sinusoidal Encodings"), and the diffusion timestep
embedding with its MLP (diffusers names `linear_1`, `linear_2`). RoPE lives in rope.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def sinusoidal_positions(n_positions: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """(N, dim): PE(pos, 2i) = sin(pos / base^{2i/d}), PE(pos, 2i+1) = cos(pos / base^{2i/d})
    (Def. 14, "Sinusoidal Positional Encoding")."""
    if dim % 2:
        raise ValueError(f"dim must be even, got {dim}")
    pos = torch.arange(n_positions, dtype=torch.float32)[:, None]
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # 1 / base^{2i/d}
    pe = torch.empty(n_positions, dim)
    pe[:, 0::2] = torch.sin(pos * inv)
    pe[:, 1::2] = torch.cos(pos * inv)
    return pe


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the fixed encoding of Def. 14 ("Sinusoidal Positional Encoding") to x (B, T, dim); the table is a
    non-persistent buffer."""

    def __init__(self, dim: int, max_len: int) -> None:
        super().__init__()
        self.register_buffer("pe", sinusoidal_positions(max_len, dim), persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return x + self.pe[offset : offset + x.shape[1]].to(x.dtype)


class LearnedPositionalEmbedding(nn.Module):
    """Adds a learned (max_len, dim) table to x (B, T, dim), as in GPT-2 and ViT
    (Remark 8, "Learnable vs. Sinusoidal Encodings")."""

    def __init__(self, dim: int, max_len: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(max_len, dim) * 0.02)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        if offset + x.shape[1] > self.weight.shape[0]:
            raise ValueError(f"positions up to {offset + x.shape[1]} exceed max_len {self.weight.shape[0]}")
        return x + self.weight[offset : offset + x.shape[1]]


def timestep_embedding(
    t: torch.Tensor,
    dim: int,
    max_period: float = 10000.0,
    flip_sin_to_cos: bool = True,
    downscale_freq_shift: float = 0.0,
) -> torch.Tensor:
    """(B,) timesteps (may be fractional) -> (B, dim) sinusoidal features [cos | sin] (or [sin | cos] when not
    flipped), frequencies max_period^{-i / (dim/2 - shift)}. The defaults match Stable Diffusion's U-Net."""
    half = dim // 2
    exponent = (
        -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / (half - downscale_freq_shift)
    )
    args = t.float()[:, None] * torch.exp(exponent)[None, :]  # (B, dim/2)
    emb = torch.cat((torch.cos(args), torch.sin(args)) if flip_sin_to_cos else (torch.sin(args), torch.cos(args)), -1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


class TimestepEmbedding(nn.Module):
    """linear_1 -> SiLU -> linear_2: lifts the sinusoidal timestep features to the width the ResBlocks consume."""

    def __init__(self, in_dim: int, time_embed_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, time_embed_dim)
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, t_features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(t_features)))
