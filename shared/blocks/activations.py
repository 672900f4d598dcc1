"""Activation functions (Def. 2, "Common Activation Functions", of the chapter "Deep Learning Building Blocks")
behind one factory, `activation(name)`.

Remark 1 of the chapter ("Which Activation Where?") says where each one is used: ReLU/LeakyReLU in CNNs and GAN
discriminators, GELU/SiLU in Transformers and diffusion U-Nets, sigmoid for probabilities and LSTM gates, tanh for image
outputs in [-1, 1].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class QuickGELU(nn.Module):
    """z sigmoid(1.702 z): the sigmoid approximation of GELU that CLIP was trained with (Hendrycks & Gimpel 2016)."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z * torch.sigmoid(1.702 * z)


_ACTIVATIONS: dict[str, Callable[..., nn.Module]] = {
    "sigmoid": nn.Sigmoid,  # 1 / (1 + e^{-z})
    "tanh": nn.Tanh,
    "relu": nn.ReLU,  # max(0, z)
    "leaky_relu": nn.LeakyReLU,  # max(alpha z, z), alpha = negative_slope << 1
    "gelu": nn.GELU,  # z Phi(z), exact Gaussian CDF
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),  # the tanh approximation of Phi used by GPT-2
    "quick_gelu": QuickGELU,
    "silu": nn.SiLU,  # z sigmoid(z), a.k.a. Swish
    "swish": nn.SiLU,
}

ACTIVATION_NAMES: tuple[str, ...] = tuple(_ACTIVATIONS)


def activation(name: str, **kwargs: float) -> nn.Module:
    """Return a fresh activation module for `name` (Def. 2, "Common Activation Functions"); keyword arguments such
    as `negative_slope` pass through.

    Raises ValueError on an unknown name rather than silently falling back.
    """
    try:
        factory = _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; expected one of {', '.join(ACTIVATION_NAMES)}") from None
    return factory(**kwargs)
