"""Normalisation layers and one factory `norm(name, dim)`, after the chapter "Deep Learning Building Blocks": Def. 5
"Batch Normalisation", Def. 6 "Layer Normalisation", Def. 19 "Root Mean Square Layer Normalisation" and Remark 3
"Which Normalisation Where?".

BatchNorm normalises each feature over the batch, LayerNorm each sample over its features, GroupNorm each sample over
groups of channels, RMSNorm each sample by its root mean square without centring. torch's BatchNorm/LayerNorm are
the implementation of Defs. 5-6 ("Batch Normalisation", "Layer Normalisation"); RMSNorm and GroupNorm run through
the backend, so CUDA gets the fused RMSNorm kernel and a CPU the one-pass GroupNorm(+SiLU) kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from genserve.shared.blocks.backend import Backend, get_backend


class RMSNorm(nn.Module):
    """RMSNorm(x) = x / RMS(x) * gamma, RMS(x) = sqrt(mean(x^2) + eps)
    (Def. 19, "Root Mean Square Layer Normalisation"); `weight` is gamma.

    forward(x, residual) fuses the pre-norm residual add: it returns (norm(x + residual), x + residual).
    With `unit_offset` the gain is 1 + w and w starts at zero (Gemma's checkpoints store it so).
    """

    def __init__(self, dim: int, eps: float = 1e-6, backend: Backend | None = None, unit_offset: bool = False) -> None:
        super().__init__()
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.backend = backend or get_backend()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        gain = 1.0 + self.weight.float() if self.unit_offset else self.weight
        return self.backend.rms_norm(x, gain, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GroupNorm(nn.GroupNorm):
    """GroupNorm (Def. 6, "Layer Normalisation") of x (B, C, ...) over groups of C / num_groups channels, with
    nn.GroupNorm's parameters and names. forward(x, silu=True) applies SiLU in the same pass: the norm -> SiLU pair
    that opens every stage of a U-Net or VAE residual block."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 backend: Backend | None = None) -> None:
        super().__init__(num_groups, num_channels, eps=eps, affine=affine)
        self.backend = backend or get_backend()

    def forward(self, x: torch.Tensor, silu: bool = False) -> torch.Tensor:
        return self.backend.group_norm(x, self.num_groups, self.weight, self.bias, self.eps, silu=silu)


def group_norm(channels: int, groups: int = 32, eps: float = 1e-6, affine: bool = True) -> GroupNorm:
    """GroupNorm over `groups` groups of channels; raises when the groups do not divide the channels."""
    if channels % groups:
        raise ValueError(f"groups ({groups}) must divide channels ({channels})")
    return GroupNorm(groups, channels, eps=eps, affine=affine)


NORM_NAMES = ("rmsnorm", "layernorm", "batchnorm", "batchnorm2d", "groupnorm")


def norm(name: str, dim: int, **kwargs) -> nn.Module:
    """Build a normalisation layer over `dim` features/channels by name.

    "rmsnorm" (eps, backend), "layernorm" (eps, elementwise_affine, bias), "batchnorm" for (B, F) or (B, C, L),
    "batchnorm2d" for (B, C, H, W) (eps, momentum, affine), "groupnorm" (groups, eps, affine).
    """
    if name == "rmsnorm":
        return RMSNorm(dim, **kwargs)
    if name == "layernorm":
        return nn.LayerNorm(dim, **kwargs)
    if name == "batchnorm":
        return nn.BatchNorm1d(dim, **kwargs)
    if name == "batchnorm2d":
        return nn.BatchNorm2d(dim, **kwargs)
    if name == "groupnorm":
        return group_norm(dim, **kwargs)
    raise ValueError(f"unknown norm {name!r}; expected one of {', '.join(NORM_NAMES)}")
