"""GAN quality, read by the attribute reader: validity (one shape in a palette colour) and shape×colour coverage."""

from __future__ import annotations

from genserve.services.gan.model import Generator
from genserve.services.gan.sampling import generate, sample_latents
from genserve.services.shapes.dataset import COLOURS, SHAPES
from genserve.services.shapes.reader import is_valid, read_batch


def evaluate(generator: Generator, n_draws: int = 1000, seed: int = 0, truncation: float | None = None) -> dict:
    """Read ``n_draws`` seeded samples: fraction valid, and fraction of the shape×colour combinations that occur
    among the valid ones."""
    z = sample_latents(n_draws, seed=seed, truncation=truncation, z_dim=generator.config.z_dim)
    read = read_batch(generate(generator, z))
    valid = [r for r in read if is_valid(r)]
    combos = {(r["shape"], r["colour"]) for r in valid}
    return {"validity": len(valid) / n_draws, "coverage": len(combos) / (len(SHAPES) * len(COLOURS))}
