from __future__ import annotations

import pytest
import torch

from genserve.services.gan.model import GANConfig, Generator
from genserve.services.gan.sampling import generate, sample_latents, slerp


def test_seeded_latents_are_reproducible_and_seed_dependent():
    torch.testing.assert_close(sample_latents(4, seed=3), sample_latents(4, seed=3), rtol=0, atol=0)
    assert not torch.equal(sample_latents(4, seed=3), sample_latents(4, seed=4))
    assert sample_latents(4, seed=0, z_dim=16).shape == (4, 16)


@pytest.mark.parametrize("truncation", [0.5, 1.0, 2.0])
def test_truncation_bounds_every_entry(truncation):
    z = sample_latents(500, seed=1, truncation=truncation)
    assert z.abs().max() <= truncation
    # Resampling, not clamping: no mass piles up at the bound.
    assert (z.abs() > 0.99 * truncation).float().mean() < 0.05


def test_truncation_keeps_entries_already_inside():
    plain, truncated = sample_latents(200, seed=2), sample_latents(200, seed=2, truncation=1.5)
    inside = plain.abs() <= 1.5
    torch.testing.assert_close(truncated[inside], plain[inside], rtol=0, atol=0)


def test_truncation_must_be_positive():
    with pytest.raises(ValueError, match="truncation"):
        sample_latents(2, seed=0, truncation=0.0)


def test_slerp_hits_both_endpoints():
    z0, z1 = sample_latents(3, seed=5), sample_latents(3, seed=6)
    torch.testing.assert_close(slerp(z0, z1, 0.0), z0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(slerp(z0, z1, 1.0), z1, rtol=1e-5, atol=1e-5)


def test_slerp_keeps_the_norm_between_equal_norm_endpoints_and_lerp_does_not():
    z0, z1 = torch.tensor([[3.0, 0.0]]), torch.tensor([[0.0, 3.0]])
    for t in (0.25, 0.5, 0.8):
        assert slerp(z0, z1, t).norm().item() == pytest.approx(3.0, rel=1e-5)
    torch.testing.assert_close(slerp(z0, z1, 0.5), torch.tensor([[3 / 2**0.5, 3 / 2**0.5]]))
    assert ((z0 + z1) / 2).norm().item() < 2.2


def test_slerp_accepts_a_tensor_of_steps_and_parallel_vectors():
    z0, z1 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    path = slerp(z0.expand(5, 2), z1.expand(5, 2), torch.linspace(0, 1, 5))
    assert path.shape == (5, 2)
    torch.testing.assert_close(path.norm(dim=1), torch.ones(5))
    same = torch.tensor([[2.0, 2.0]])
    torch.testing.assert_close(slerp(same, same, 0.3), same)


def test_generate_is_deterministic_in_eval_mode_and_restores_training_mode():
    generator = Generator(GANConfig(z_dim=8, g_channels=(16, 8, 8, 4), d_channels=(4, 8, 8)))
    z = sample_latents(6, seed=0, z_dim=8)
    first = generate(generator, z, batch_size=4)
    torch.testing.assert_close(generate(generator, z), first, rtol=0, atol=1e-6)
    assert first.shape == (6, 3, 32, 32) and generator.training


def test_generate_rejects_wrong_latent_width():
    generator = Generator(GANConfig(z_dim=8, g_channels=(16, 8, 8, 4), d_channels=(4, 8, 8)))
    with pytest.raises(ValueError, match="z must be"):
        generate(generator, torch.randn(2, 9))


def test_recalibrated_batchnorm_matches_the_statistics_of_fresh_latents():
    from genserve.services.gan.sampling import recalibrate_batchnorm

    generator = Generator(GANConfig(z_dim=8, g_channels=(16, 8, 8, 4), d_channels=(4, 8, 8)))
    generator.project_norm.running_mean.fill_(5.0)  # stale statistics, as in a weight-averaged generator
    recalibrate_batchnorm(generator, n_batches=4, batch_size=64, seed=0)
    assert not generator.training and generator.project_norm.momentum == 0.1
    z = sample_latents(256, seed=0, z_dim=8)
    with torch.no_grad():
        pre_norm = generator.project(z).view(256, -1, 4, 4)
    torch.testing.assert_close(generator.project_norm.running_mean, pre_norm.mean(dim=(0, 2, 3)), rtol=1e-4, atol=1e-5)
