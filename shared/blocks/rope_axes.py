"""Rotary positions over several axes at once (Su et al. 2021, "RoFormer", §3.4, extended to N-D as in Flux,
Black Forest Labs 2024): each token carries integer ids (e.g. (0, row, col) for an image patch, (0, 0, 0) for a text
token), each axis owns a slice of the head dimension, and the angles of axis a on its slice are id_a · θ^{−2i/d_a}.
The cos/sin come out with each angle repeated for its channel pair (the interleaved layout of
shared/blocks/joint_attention.apply_rotary). Angles are computed in float64, as diffusers' FluxPosEmbed does on CPU.
"""

from __future__ import annotations

import torch


def axes_rotary(ids: torch.Tensor, axes_dim: tuple[int, ...], theta: float = 10000.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (N, n_axes) -> (cos, sin), each (N, sum(axes_dim)) in float32."""
    if ids.shape[-1] != len(axes_dim):
        raise ValueError(f"ids have {ids.shape[-1]} axes, axes_dim {len(axes_dim)}")
    cos, sin = [], []
    dtype = torch.float32 if ids.device.type == "mps" else torch.float64
    for axis, dim in enumerate(axes_dim):
        if dim % 2:
            raise ValueError(f"each axis needs an even dim, got {dim}")
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=dtype, device=ids.device)[: dim // 2] / dim)
        angles = torch.outer(ids[:, axis].to(dtype), freqs)  # (N, dim/2)
        cos.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def image_ids(h: int, w: int, device: torch.device | None = None) -> torch.Tensor:
    """(h·w, 3) ids (0, row, col) of an h × w grid of patches, row-major."""
    rows = torch.arange(h, device=device).repeat_interleave(w)
    cols = torch.arange(w, device=device).repeat(h)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).float()
