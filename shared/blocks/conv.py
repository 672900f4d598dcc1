"""Convolutions (Def. 7, "2D Convolution Layer", of the chapter "Deep Learning Building Blocks"), transposed
convolutions (Def. 8, "Transposed Convolution"), the two up/down-sampling layers of U-Nets and GANs (Remark 4,
"Checkerboard Artifacts") and pooling, with the output-size arithmetic of Example 1 ("Convolution Arithmetic") and the
chapter's Exercises 5-6.

Downsample and Upsample keep diffusers' submodule name `conv` so their checkpoints map 1:1. `Conv2d` is nn.Conv2d
with its product dispatched through the backend (same parameters, same checkpoint names).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from genserve.shared.blocks.backend import Backend, PreparedWeights, get_backend


def conv_out(n: int, k: int, s: int = 1, p: int = 0, dilation: int = 1) -> int:
    """Output length of a convolution: floor((n + 2p - dilation (k - 1) - 1) / s) + 1 (the forward rule of Def. 8,
    "Transposed Convolution")."""
    return (n + 2 * p - dilation * (k - 1) - 1) // s + 1


def transposed_conv_out(n: int, k: int, s: int = 1, p: int = 0, op: int = 0) -> int:
    """Output length of a transposed convolution: (n - 1) s - 2p + k + op, the inverse of `conv_out`."""
    return (n - 1) * s - 2 * p + k + op


class Conv2d(nn.Conv2d):
    """A zero-padded 2-D convolution (Def. 7, "2D Convolution Layer"), dilation 1, groups 1: x (B, in_ch, H, W) ->
    (B, out_ch, H', W') with H' = conv_out(H, k, stride, padding). The backend may keep the weight prepared for its
    compute in ``self.prepared`` (on the CPU, reordered once for oneDNN: kernels/cpu_conv.py)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0,
                 bias: bool = True, backend: Backend | None = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=bias)
        self.backend = backend or get_backend()
        self.prepared = PreparedWeights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.conv2d(x, self.weight, self.bias, stride=self.stride, padding=self.padding,
                                   prepared=self.prepared)


def conv2d_same(in_ch: int, out_ch: int, kernel_size: int = 3, stride: int = 1, bias: bool = True) -> Conv2d:
    """A Conv2d with "same" padding k // 2: H x W -> H x W at stride 1, ceil(H/s) x ceil(W/s) at stride s."""
    if kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be odd for same padding, got {kernel_size}")
    return Conv2d(in_ch, out_ch, kernel_size, stride=stride, padding=kernel_size // 2, bias=bias)


def conv_transpose(
    in_ch: int,
    out_ch: int,
    kernel_size: int = 4,
    stride: int = 2,
    padding: int = 1,
    output_padding: int = 0,
    bias: bool = True,
) -> nn.ConvTranspose2d:
    """A learned upsampling layer (Def. 8, "Transposed Convolution"); size follows `transposed_conv_out`. Kernel 4,
    stride 2, padding 1 exactly doubles (the DCGAN generator step). A kernel not divisible by the stride risks
    checkerboard artifacts (Remark 4, "Checkerboard Artifacts"); `Upsample` is the artifact-free alternative."""
    return nn.ConvTranspose2d(in_ch, out_ch, kernel_size, stride, padding, output_padding, bias=bias)


def has_checkerboard_risk(kernel_size: int, stride: int) -> bool:
    """Remark 4 ("Checkerboard Artifacts"): transposed convolutions overlap unevenly when the kernel size is not
    divisible by the stride."""
    return kernel_size % stride != 0


class Downsample(nn.Module):
    """Halve H and W with a learnable 3x3 stride-2 convolution (strided conv replaces pooling in generators).

    padding=1 is the diffusers U-Net form; padding=0 pads (0, 1, 0, 1) first, the diffusers/SD VAE encoder form.
    """

    def __init__(self, channels: int, out_channels: int | None = None, padding: int = 1) -> None:
        super().__init__()
        if padding not in (0, 1):
            raise ValueError(f"padding must be 0 or 1, got {padding}")
        self.padding = padding
        self.conv = Conv2d(channels, out_channels or channels, 3, stride=2, padding=padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.padding == 0:
            x = F.pad(x, (0, 1, 0, 1))
        return self.conv(x)  # (B, C, H/2, W/2)


class Upsample(nn.Module):
    """Double H and W by nearest-neighbour interpolation followed by a 3x3 convolution (no checkerboard:
    Remark 4, "Checkerboard Artifacts")."""

    def __init__(self, channels: int, out_channels: int | None = None) -> None:
        super().__init__()
        self.conv = Conv2d(channels, out_channels or channels, 3, padding=1)

    def forward(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        """``size``: the output (H, W) when it is not exactly 2H × 2W (a U-Net skip of odd size)."""
        if size is not None and tuple(size) != (2 * x.shape[-2], 2 * x.shape[-1]):
            return self.conv(F.interpolate(x, size=size, mode="nearest"))
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))  # (B, C, 2H, 2W)


def pool(name: str, kernel_size: int = 2, stride: int | None = None) -> nn.Module:
    """ "max" or "avg" pooling over kernel_size windows, or "global_avg" (the discriminator head): (B, C, 1, 1)."""
    if name == "max":
        return nn.MaxPool2d(kernel_size, stride)
    if name == "avg":
        return nn.AvgPool2d(kernel_size, stride)
    if name == "global_avg":
        return nn.AdaptiveAvgPool2d(1)
    raise ValueError(f"unknown pooling {name!r}; expected 'max', 'avg' or 'global_avg'")
