"""The committed demo generator (services/gan/weights): it loads and its samples read as valid, varied shapes, at
the goals docs/models.md states (>= 0.90 valid and >= 0.90 of the shape×colour classes, over 1000 draws)."""

from __future__ import annotations

from genserve.services.gan.evaluate import evaluate
from genserve.services.gan.model import load_generator


def test_committed_generator_samples_are_mostly_valid_and_varied():
    metrics = evaluate(load_generator(), n_draws=1000, seed=0)
    assert metrics["validity"] >= 0.90
    assert metrics["coverage"] >= 0.90
