"""Where each service's committed demo checkpoint lies (services/<name>/weights: config.json + model.safetensors),
for the services that build on another one's model (the latent GAN and the diffusion model train and are scored
in the VAE's latent space) without importing that service."""

from __future__ import annotations

from pathlib import Path

SERVICES = ("text", "gan", "vae", "diffusion")


def committed_weights(service: str) -> Path:
    if service not in SERVICES:
        raise ValueError(f"service must be one of {SERVICES}, got {service!r}")
    return Path(__file__).resolve().parents[1] / service / "weights"
