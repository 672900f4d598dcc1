"""The affine map z = W a + b of Def. 1 ("Feedforward Neural Network", in the chapter "Deep Learning Building Blocks")
as a module whose product goes through the backend.

Parameters and their names are ``nn.Linear``'s, so checkpoints load unchanged; only the compute is dispatched, which
lets a CPU decode step run on the GEMV kernel (shared/blocks/backend.py).
"""

from __future__ import annotations

import torch
from torch import nn

from genserve.shared.blocks.backend import Backend, get_backend


class Linear(nn.Linear):
    """y = x W^T + b, x (..., in_features) -> (..., out_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, backend: Backend | None = None):
        super().__init__(in_features, out_features, bias=bias)
        self.backend = backend or get_backend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.weight, self.bias)


class RowwiseLinear(nn.Linear):
    """y = x W^T + b for x (B, in_features), computed as B separate one-row products (one baddbmm), so every row's
    result is bit-identical whatever the number of rows beside it. A single F.linear call is not: MKL's sgemm takes
    other kernels for 1-3 rows than for more, and their sums round differently (up to 4e-7 here). For a layer at the
    input of an image model (the GAN's projection of z), where one (B, K) @ (K, N) costs microseconds either way,
    that keeps a served image independent of the requests it was batched with. Parameters are nn.Linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        bias = self.bias if self.bias is not None else x.new_zeros(self.out_features)
        rows = torch.baddbmm(bias.expand(b, 1, -1), x.unsqueeze(1), self.weight.t().expand(b, -1, -1))
        return rows.squeeze(1)  # (B, out_features)
