"""Sampling the GAN: seeded latents with the truncation trick, spherical interpolation, batched generation."""

from __future__ import annotations

import torch

from genserve.services.gan.model import Generator


def sample_latents(n: int, seed: int, truncation: float | None = None, z_dim: int = 64) -> torch.Tensor:
    """``n`` latents z ~ N(0, I_{z_dim}) from ``seed``; with ``truncation`` t > 0 every entry with |z| > t is redrawn
    until it falls inside (the truncation trick, Brock et al. 2019 §3.1): less variety, cleaner samples."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if truncation is not None and truncation <= 0:
        raise ValueError(f"truncation must be > 0 or None, got {truncation}")
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(n, z_dim, generator=generator)
    if truncation is None:
        return z
    outside = z.abs() > truncation
    while outside.any():
        z[outside] = torch.randn(int(outside.sum()), generator=generator)
        outside = z.abs() > truncation
    return z


def slerp(z0: torch.Tensor, z1: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
    """Spherical linear interpolation along the last dim (Shoemake 1985; White 2016 for GAN latents):
        slerp(z0, z1; t) = sin((1-t)Ω)/sin Ω · z0 + sin(tΩ)/sin Ω · z1,  cos Ω = <z0, z1> / (|z0| |z1|).
    Equals z0 at t=0 and z1 at t=1; keeps the norm when |z0| = |z1|. Falls back to linear interpolation for (nearly)
    parallel vectors, where sin Ω → 0. ``t`` may be a scalar or a tensor broadcasting against z0[..., :1]."""
    t = torch.as_tensor(t, dtype=z0.dtype, device=z0.device)
    if t.ndim == 0:
        t = t.expand(z0.shape[:-1]).unsqueeze(-1)
    elif t.shape[-1] != 1:
        t = t.unsqueeze(-1)
    cos = (z0 * z1).sum(-1, keepdim=True) / (z0.norm(dim=-1, keepdim=True) * z1.norm(dim=-1, keepdim=True))
    omega = torch.arccos(cos.clamp(-1.0, 1.0))
    sin = torch.sin(omega)
    parallel = sin.abs() < 1e-6
    safe_sin = torch.where(parallel, torch.ones_like(sin), sin)
    spherical = (torch.sin((1 - t) * omega) * z0 + torch.sin(t * omega) * z1) / safe_sin
    linear = (1 - t) * z0 + t * z1
    return torch.where(parallel, linear, spherical)


@torch.no_grad()
def recalibrate_batchnorm(generator: Generator, n_batches: int = 16, batch_size: int = 128, seed: int = 0) -> None:
    """Re-estimate every BatchNorm's running mean/var from the generator's own activations.

    Needed for a weight-averaged (EMA) generator: its averaged weights do not match running statistics collected by
    the raw generator, and eval-mode samples come out washed out. Uses a cumulative average over ``n_batches``
    batches of z ~ N(0, I), then leaves the generator in eval mode.
    """
    norms = [m for m in generator.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative moving average: every batch weighs the same
    generator.train()
    z = sample_latents(n_batches * batch_size, seed=seed, z_dim=generator.config.z_dim)
    for chunk in z.split(batch_size):
        generator.features(chunk)  # BatchNorm lives before any frozen decoder
    for m, momentum in zip(norms, momenta, strict=True):
        m.momentum = momentum
    generator.eval()


@torch.no_grad()
def generate(generator: Generator, z: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """Images (N, 3, 32, 32) in [-1, 1] for latents z (N, z_dim), in eval mode (BatchNorm uses its running stats)."""
    if z.ndim != 2 or z.shape[1] != generator.config.z_dim:
        raise ValueError(f"z must be (N, {generator.config.z_dim}), got {tuple(z.shape)}")
    was_training = generator.training
    generator.eval()
    device = next(generator.parameters()).device
    images = [generator(chunk.to(device)).cpu() for chunk in z.split(batch_size)]
    generator.train(was_training)
    return torch.cat(images) if images else torch.zeros(0, 3, generator.config.image_size, generator.config.image_size)
