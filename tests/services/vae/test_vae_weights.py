"""The committed demo weights (services/vae/weights): they load, reconstruct held-out images well, and their
scaling_factor gives unit-variance latents. Skipped until the weights exist."""

from __future__ import annotations

import pytest
import torch

from services.shapes.dataset import sample_batch
from services.vae.evaluate import psnr, reconstruct_in_batches
from services.vae.model import DEFAULT_WEIGHTS, load_vae

pytestmark = pytest.mark.skipif(
    not (DEFAULT_WEIGHTS / "model.safetensors").exists(), reason="no committed VAE weights yet"
)


def test_committed_vae_reconstructs_heldout_images_above_the_psnr_floor():
    images, _, _ = sample_batch(100, seed=0, split="heldout")
    assert psnr(images, reconstruct_in_batches(load_vae(), images)) >= 27.0


@torch.no_grad()
def test_committed_scaling_factor_gives_unit_variance_latents():
    vae = load_vae()
    images, _, _ = sample_batch(200, seed=1, split="heldout")
    assert (vae.encode(images)[0] * vae.scaling_factor).std().item() == pytest.approx(1.0, abs=0.1)
