"""Adaptive LayerNorm modulation of diffusion transformers (Peebles & Xie 2023, "Scalable Diffusion Models with
Transformers", §3.2 "adaLN-Zero"): the conditioning vector c (timestep + pooled text) is mapped by SiLU → Linear to
per-channel shift β, scale γ and gate α, and a block computes x + α ⊙ f(LN(x) (1 + γ) + β). The gate's weights start
at zero, so every block starts as the identity. SD3's MMDiT (Esser et al. 2024, Fig. 2) and Flux use it per stream.

Names follow diffusers (``linear``; ``norm`` for the affine-free LayerNorm) so their checkpoints map 1:1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (B, N, D) · (1 + scale) + shift, both (B, D)."""
    return x * (1 + scale[:, None]) + shift[:, None]


class AdaLayerNormZero(nn.Module):
    """(x, c) -> (LN(x) modulated for attention, gate_msa, shift_mlp, scale_mlp, gate_mlp): six vectors from c, in
    diffusers' order (shift, scale, gate) × (attention, MLP)."""

    def __init__(self, dim: int, cond_dim: int | None = None, eps: float = 1e-6) -> None:
        super().__init__()
        self.linear = nn.Linear(cond_dim or dim, 6 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(F.silu(c)).chunk(6, dim=1)
        return modulate(self.norm(x), shift_msa, scale_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroSingle(nn.Module):
    """(x, c) -> (LN(x) modulated, gate): three vectors (shift, scale, gate), for Flux's single-stream blocks."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shift, scale, gate = self.linear(F.silu(c)).chunk(3, dim=1)
        return modulate(self.norm(x), shift, scale), gate


class AdaLayerNormContinuous(nn.Module):
    """(x, c) -> LN(x) (1 + scale) + shift with no gate: the final norm of a DiT, and of the text stream in SD3's
    last block (which only feeds attention). diffusers' order here is (scale, shift)."""

    def __init__(self, dim: int, cond_dim: int | None = None, eps: float = 1e-6, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(cond_dim or dim, 2 * dim, bias=bias)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(c).to(x.dtype)).chunk(2, dim=1)
        return modulate(self.norm(x), shift, scale)
