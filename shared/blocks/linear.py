"""The affine map z = W a + b of Def. 1 as a module whose product goes through the backend.

Parameters and their names are ``nn.Linear``'s, so checkpoints load unchanged; only the compute is dispatched, which
lets a CPU decode step run on the GEMV kernel (shared/blocks/backend.py).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.blocks.backend import Backend, get_backend


class Linear(nn.Linear):
    """y = x W^T + b, x (..., in_features) -> (..., out_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, backend: Backend | None = None):
        super().__init__(in_features, out_features, bias=bias)
        self.backend = backend or get_backend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.weight, self.bias)
