"""Feedforward networks: the MLP of Def. 1 ("Feedforward Neural Network") of the chapter
"Deep Learning Building Blocks", the GELU FFN of the Transformer block, SwiGLU (Def. 20, "SwiGLU"; Remark 15,
"SwiGLU in Practice") and GEGLU (Shazeer 2020), the feedforward of Stable Diffusion's transformer blocks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from genserve.shared.blocks.activations import activation
from genserve.shared.blocks.backend import Backend
from genserve.shared.blocks.linear import Linear


class MLP(nn.Module):
    """z_l = W_l a_{l-1} + b_l, a_l = sigma(z_l) for l = 1..L (Def. 1, "Feedforward Neural Network"); the last layer
    is linear unless `final_activation` is set. `widths` = (d_0, d_1, ..., d_L); the layers are
    `layers.0 .. layers.{L-1}`."""

    def __init__(
        self,
        widths: Sequence[int],
        act: str = "relu",
        bias: bool = True,
        final_activation: str | None = None,
    ) -> None:
        super().__init__()
        if len(widths) < 2:
            raise ValueError(f"widths needs at least input and output sizes, got {list(widths)}")
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(widths[:-1], widths[1:], strict=True))
        self.act = activation(act)
        self.final_act = activation(final_activation) if final_activation else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = self.act(layer(x))
        return self.final_act(self.layers[-1](x))


class GeluFFN(nn.Module):
    """FFN(x) = W_2 sigma(W_1 x + b_1) + b_2 with GELU (the feedforward of Algorithm 2,
    "Transformer Encoder Block"); names `fc1`, `fc2`."""

    def __init__(self, dim: int, hidden_dim: int | None = None, act: str = "gelu", bias: bool = True) -> None:
        super().__init__()
        hidden_dim = hidden_dim or 4 * dim
        self.fc1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.act = activation(act)
        self.fc2 = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GEGLU(nn.Module):
    """GEGLU(x) = (x W + b) * GELU(x V + c) (Shazeer 2020, Eq. 5), with W and V stacked in one projection `proj`
    (2·hidden × dim) whose first half is the value and second half the gate, as diffusers stores it."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 2 * hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.proj(x).chunk(2, dim=-1)  # (..., hidden) each
        return value * nn.functional.gelu(gate)


class GegluFFN(nn.Module):
    """FFN(x) = W_2 GEGLU(x) + b_2; names follow diffusers' FeedForward (`net.0.proj`, `net.2`) so its checkpoints
    map 1:1 (`net.1` is diffusers' dropout, which holds no weights)."""

    def __init__(self, dim: int, hidden_dim: int | None = None) -> None:
        super().__init__()
        hidden_dim = hidden_dim or 4 * dim
        self.net = nn.ModuleList([GEGLU(dim, hidden_dim), nn.Identity(), nn.Linear(hidden_dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


def swiglu_hidden_dim(dim: int, multiple_of: int = 256) -> int:
    """d_ff = floor(2/3 * 4d) rounded up to a multiple of `multiple_of` (Remark 15, "SwiGLU in Practice";
    LLaMA's rule)."""
    hidden = (2 * 4 * dim) // 3
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


GATED_ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_clamped")


class SwiGLU(nn.Module):
    """SwiGLU(x) = (Swish(x W_1) * (x V)) W_2 (Def. 20, "SwiGLU"), and its gated-linear-unit siblings (Shazeer 2020)
    by `activation`: "gelu_tanh" is GeGLU with the tanh GELU (Gemma); "swiglu_clamped" is gpt-oss's
    (V x + 1) * g sigmoid(alpha g), g = min(W_1 x, limit), V x clamped to [-limit, limit].

    Names follow HF Llama so checkpoints map 1:1: W_1 = `gate_proj`, V = `up_proj`, W_2 = `down_proj`.
    """

    def __init__(self, dim: int, hidden_dim: int | None = None, bias: bool = False, backend: Backend | None = None,
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")
        hidden_dim = hidden_dim or swiglu_hidden_dim(dim)
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.gate_proj = Linear(dim, hidden_dim, bias=bias, backend=backend)
        self.up_proj = Linear(dim, hidden_dim, bias=bias, backend=backend)
        self.down_proj = Linear(hidden_dim, dim, bias=bias, backend=backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation == "silu":
            return self.down_proj(nn.functional.silu(gate) * up)
        if self.activation == "gelu_tanh":
            return self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return self.down_proj((up + 1) * gate * torch.sigmoid(gate * self.alpha))
