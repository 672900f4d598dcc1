from __future__ import annotations

import dataclasses

import pytest
import torch

from services.shapes.dataset import sample_batch
from services.vae.evaluate import psnr
from services.vae.model import VAE, VAEConfig, load_vae
from shared.checkpoint import save_checkpoint

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


def test_module_tree_uses_autoencoderkl_names(vae):
    names = set(vae.state_dict())
    for key in (
        "encoder.conv_in.weight",
        "encoder.down_blocks.0.resnets.0.norm1.weight",
        "encoder.down_blocks.0.downsamplers.0.conv.weight",
        "encoder.mid_block.resnets.1.conv2.weight",
        "encoder.conv_norm_out.weight",
        "encoder.conv_out.weight",
        "quant_conv.weight",
        "post_quant_conv.weight",
        "decoder.up_blocks.0.resnets.1.conv1.weight",
        "decoder.up_blocks.1.upsamplers.0.conv.weight",
        "decoder.conv_out.weight",
    ):
        assert key in names, key
    assert vae.encoder.conv_out.out_channels == 2 * TINY.latent_channels


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
