"""GroupNorm with its affine map and an optional SiLU in one pass, for fp32 CPU activations (csrc/group_norm.c).

A U-Net residual block at latent size normalises tensors of a few thousand elements, where torch's group_norm
and silu cost far more in dispatch than in arithmetic; torch's GroupNorm is also several times slower on the
channels-last tensors that the prepared oneDNN convolutions (kernels/cpu_conv.py) return. This kernel reads either
layout and writes the output in the input's.
"""

from __future__ import annotations

import torch

from genserve.kernels._cpu_library import library


def supports(x: torch.Tensor) -> bool:
    """True for a non-empty fp32 CPU (B, C, H, W) tensor stored NCHW- or channels-last-contiguous, with the
    kernels built on this machine."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 4 and x.numel() > 0
            and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)) and library() is not None)


def _fp32(t: torch.Tensor, c: int) -> torch.Tensor:
    if t.shape != (c,):
        raise ValueError(f"group_norm: expected a per-channel ({c},) weight or bias, got {tuple(t.shape)}")
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.to(torch.float32).contiguous()


def group_norm(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
               *, silu: bool = False) -> torch.Tensor:
    """F.group_norm(x, groups, weight, bias, eps), then F.silu when ``silu``; forward only, check ``supports``."""
    b, c, h, w = x.shape
    if c % groups:
        raise ValueError(f"group_norm: groups ({groups}) must divide the channels ({c})")
    channels_last = not x.is_contiguous()
    y = torch.empty_like(x)  # keeps x's layout
    affine = [None if t is None else _fp32(t, c).data_ptr() for t in (weight, bias)]
    if library().group_norm_f32(x.data_ptr(), *affine, y.data_ptr(), b, c, h * w, groups, eps, channels_last, silu):
        raise MemoryError("group_norm: scratch allocation failed")
    return y
