from __future__ import annotations

import dataclasses

import pytest
import torch

from genserve.services.shapes.dataset import sample_batch
from genserve.services.vae.evaluate import psnr
from genserve.services.vae.model import load_vae
from genserve.shared.blocks.autoencoder import VAE, VAEConfig
from genserve.shared.checkpoint import save_checkpoint

TINY = VAEConfig(block_out_channels=(8, 16, 16), norm_groups=4)


@pytest.fixture
def vae() -> VAE:
    return VAE(TINY)


def test_encode_gives_mean_and_logvar_of_the_latent_shape(vae):
    x = torch.randn(2, 3, 32, 32)
    mean, logvar = vae.encode(x)
    assert mean.shape == logvar.shape == (2, 4, 8, 8) == (2, *TINY.latent_shape)


def test_decode_reconstruct_and_sample_give_image_shapes(vae):
    assert vae.decode(torch.randn(3, 4, 8, 8)).shape == (3, 3, 32, 32)
    assert vae.reconstruct(torch.randn(2, 3, 32, 32)).shape == (2, 3, 32, 32)
    assert vae.sample(5, generator=torch.Generator().manual_seed(0)).shape == (5, 3, 32, 32)


def test_reconstruct_is_deterministic_and_close_to_held_out_images():
    """The round trip goes through the posterior mean, not a sample: two calls agree bit for bit, and the committed
    weights bring held-out shapes back (docs/models.md: 32 dB on 1,000 images)."""
    vae = load_vae(None)
    images, _, _ = sample_batch(8, seed=987654, split="heldout")
    with torch.inference_mode():
        first, second = vae.reconstruct(images), vae.reconstruct(images)
    assert torch.equal(first, second)
    assert psnr(images, first) > 25.0


def test_seeded_prior_samples_are_reproducible(vae):
    a = vae.sample(2, generator=torch.Generator().manual_seed(7))
    b = vae.sample(2, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_loss_gradients_reach_the_first_encoder_layer(vae):
    images, _, _ = sample_batch(4, seed=0)
    losses = vae.loss(images, generator=torch.Generator().manual_seed(0))
    losses["loss"].backward()
    grad = vae.encoder.conv_in.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    assert vae.decoder.conv_out.weight.grad.abs().sum() > 0


def test_kl_term_matches_the_closed_form(vae):
    x = torch.randn(2, 3, 32, 32)
    mean, logvar = vae.encode(x)
    expected = 0.5 * (mean**2 + logvar.exp() - 1 - logvar).mean()
    torch.testing.assert_close(vae.loss(x)["kl"], expected, rtol=1e-5, atol=1e-7)


def test_the_demo_vae_is_an_autoencoderkl_without_mid_attention(vae):
    """Values, not names: diffusers' AutoencoderKL with the same config (no mid-block attention) and our weights
    decodes and encodes as ours does."""
    from diffusers import AutoencoderKL

    c, n = TINY, len(TINY.block_out_channels)
    ref = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                        up_block_types=("UpDecoderBlock2D",) * n,
                        block_out_channels=c.block_out_channels, layers_per_block=c.layers_per_block,
                        latent_channels=c.latent_channels, norm_num_groups=c.norm_groups,
                        mid_block_add_attention=False).eval()
    ref.load_state_dict(vae.state_dict(), strict=True)
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(vae.encode(x)[0], ref.encode(x).latent_dist.mean, rtol=1e-4, atol=1e-4)
        z = torch.randn(2, *c.latent_shape)
        torch.testing.assert_close(vae.decode(z), ref.decode(z).sample, rtol=1e-4, atol=1e-4)


def test_checkpoint_round_trip_gives_equal_outputs(vae, tmp_path):
    config = dataclasses.replace(TINY, scaling_factor=0.5)
    vae.config = config
    save_checkpoint(tmp_path, vae, config)
    loaded = load_vae(tmp_path)
    assert loaded.scaling_factor == 0.5 and loaded.config == config
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(loaded.reconstruct(x), vae.eval().reconstruct(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("latent_channels", 0), ("norm_groups", 3), ("image_size", 30), ("kl_weight", -1.0), ("scaling_factor", 0.0)],
)
def test_config_rejects_bad_fields_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        VAEConfig(**{field: value})


def test_psnr_of_known_error():
    x = torch.zeros(1, 3, 4, 4)
    assert psnr(x, x + 0.02) == pytest.approx(10 * torch.log10(torch.tensor(4 / 0.02**2)).item(), rel=1e-5)
    assert psnr(x, x) == float("inf")
