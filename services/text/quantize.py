"""Int8 weight-only quantisation of the linear layers for CPU decoding, where every step reads all weights
and memory bandwidth sets the speed: a quarter of fp32's bytes per step.

Symmetric per-output-channel scales, ``W ~= scale[:, None] * W_int8`` with ``scale = max|W_row| / 127``; the
matmul runs in ``torch._weight_int8pack_mm`` with bf16 activations (the kernel gpt-fast uses on CPU). The
embedding, norms and KV cache keep the model dtype.
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    """y = x (scale * W_int8)^T + b, a drop-in for an ``nn.Linear`` at inference."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8))  # (N, K)
        self.register_buffer("scales", scales.to(torch.bfloat16))  # (N,)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (M, K)
        y = torch._weight_int8pack_mm(flat, self.weight, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def quantize_int8_(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` by an ``Int8Linear`` in place (tied heads get their own copy)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize_int8_(child)
    return model
