"""The committed demo generator (services/gan/weights): it loads and its samples read as valid, varied shapes.
Skipped until the weights exist."""

from __future__ import annotations

import pytest

from services.gan.evaluate import evaluate
from services.gan.model import DEFAULT_WEIGHTS, load_generator

pytestmark = pytest.mark.skipif(
    not (DEFAULT_WEIGHTS / "model.safetensors").exists(), reason="no committed GAN weights yet"
)


def test_committed_generator_samples_are_mostly_valid_and_varied():
    metrics = evaluate(load_generator(), n_draws=100, seed=0)
    assert metrics["validity"] >= 0.85
    assert metrics["coverage"] >= 0.8
