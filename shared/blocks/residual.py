"""The residual block of U-Nets and VAEs (Def. 9, "Residual Block", of the chapter "Deep Learning Building Blocks"):
a_out = a_in + F(a_in), with F = two GroupNorm -> SiLU -> 3x3 conv stages, the timestep embedding added after the
first convolution (the chapter's U-Net insight), dropout before the second. Names follow diffusers' ResnetBlock2D
(`norm1`, `conv1`, `time_emb_proj`, `norm2`, `conv2`, `conv_shortcut`) so its checkpoints map 1:1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from genserve.shared.blocks.conv import Conv2d
from genserve.shared.blocks.norms import group_norm


class ResBlock(nn.Module):
    """x (B, in_ch, H, W), temb (B, temb_dim) -> (B, out_ch, H, W). The skip is a 1x1 conv when in_ch != out_ch."""

    def __init__(
        self,
        in_ch: int,
        out_ch: int | None = None,
        temb_dim: int | None = None,
        groups: int = 32,
        dropout: float = 0.0,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        out_ch = out_ch or in_ch
        self.norm1 = group_norm(in_ch, groups, eps)
        self.conv1 = Conv2d(in_ch, out_ch, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb_dim, out_ch) if temb_dim else None
        self.norm2 = group_norm(out_ch, groups, eps)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = Conv2d(out_ch, out_ch, 3, padding=1)
        self.conv_shortcut = Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        h = self.conv1(self.norm1(x, silu=True))
        if self.time_emb_proj is not None:
            if temb is None:
                raise ValueError("temb is required: this block was built with temb_dim")
            h = h + self.time_emb_proj(F.silu(temb))[:, :, None, None]  # (B, out_ch, 1, 1) broadcast over H, W
        h = self.conv2(self.dropout(self.norm2(h, silu=True)))
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return skip + h
