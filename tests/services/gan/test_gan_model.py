from __future__ import annotations

import pytest
import torch

from genserve.services.gan.model import (
    Discriminator,
    GANConfig,
    Generator,
    class_of,
    latent_classes,
    load_generator,
    minibatch_std,
)
from genserve.services.shapes.dataset import COLOURS, SHAPES
from genserve.shared.checkpoint import save_checkpoint

TINY = GANConfig(z_dim=8, g_channels=(16, 8, 8, 4), d_channels=(4, 8, 8))


def test_generator_maps_latents_to_images_in_tanh_range():
    images = Generator(TINY)(torch.randn(3, 8) * 10)
    assert images.shape == (3, 3, 32, 32)
    assert images.min() >= -1 and images.max() <= 1


def test_discriminator_gives_one_logit_per_image():
    assert Discriminator(TINY)(torch.randn(5, 3, 32, 32)).shape == (5,)


def test_gradients_reach_the_first_layer_of_both_networks():
    generator, discriminator = Generator(TINY), Discriminator(TINY)
    discriminator(generator(torch.randn(4, 8))).mean().backward()
    assert generator.project.weight.grad.abs().sum() > 0
    assert discriminator.blocks[0].parametrizations.weight.original.grad.abs().sum() > 0


def test_discriminator_layers_are_spectrally_normalised():
    discriminator = Discriminator(TINY)
    for _ in range(30):  # power iteration converges during training-mode forwards
        discriminator(torch.randn(2, 3, 32, 32))
    discriminator.eval()
    for layer in [*discriminator.blocks, discriminator.head]:
        weight = layer.weight.flatten(1)
        assert torch.linalg.matrix_norm(weight, ord=2).item() == pytest.approx(1.0, abs=0.05)


def test_minibatch_std_appends_the_batch_spread_channel():
    x = torch.tensor([[[[0.0]], [[2.0]]], [[[2.0]], [[4.0]]]])  # (B=2, C=2, 1, 1); per-feature std 1 and 1
    out = minibatch_std(x)
    assert out.shape == (2, 3, 1, 1)
    torch.testing.assert_close(out[:, 2], torch.ones(2, 1, 1))


def test_checkpoint_round_trip_gives_equal_outputs(tmp_path):
    generator = Generator(TINY)
    generator(torch.randn(8, 8))  # move BatchNorm running stats off their initial values
    save_checkpoint(tmp_path, generator, TINY)
    loaded = load_generator(tmp_path)
    z = torch.randn(4, 8)
    torch.testing.assert_close(loaded(z), generator.eval()(z), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("z_dim", 0),
        ("g_channels", (8, 8)),
        ("d_channels", (8,)),
        ("leaky_slope", 1.5),
        ("n_classes", 65),
        ("space", "voxel"),
    ],
)
def test_config_rejects_bad_fields_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        GANConfig(**{field: value})


COND = GANConfig(z_dim=30, g_channels=(16, 8, 8, 4), d_channels=(4, 8, 8), n_classes=24)


def test_latent_class_is_the_argmax_of_the_leading_coordinates():
    z = torch.zeros(2, 30)
    z[0, 5], z[1, 23], z[1, 29] = 1.0, 2.0, 9.0  # coordinate 29 lies outside the class block
    torch.testing.assert_close(latent_classes(z, 24), torch.tensor([5, 23]))


def test_latent_classes_are_uniform_even_under_truncation():
    from genserve.services.gan.sampling import sample_latents

    counts = torch.bincount(latent_classes(sample_latents(24_000, seed=0, truncation=0.5, z_dim=30), 24), minlength=24)
    assert counts.min() > 850 and counts.max() < 1150  # 1000 expected per class; ±15% is > 4 standard deviations


def test_class_of_enumerates_shape_colour_pairs():
    labels = {class_of({"shape": s, "colour": c}) for s in SHAPES for c in COLOURS}
    assert labels == set(range(len(SHAPES) * len(COLOURS)))


def test_class_of_all_attributes_enumerates_every_combination():
    from genserve.services.shapes.dataset import all_attribute_combinations

    labels = [class_of(attrs, 240) for attrs in all_attribute_combinations()]
    assert sorted(labels) == list(range(240))
    with pytest.raises(ValueError, match="n_classes"):
        class_of(all_attribute_combinations()[0], 7)


def test_conditional_generator_depends_on_the_latent_class():
    generator = Generator(COND).eval()
    with torch.no_grad():
        torch.nn.init.normal_(generator.class_embed.weight, std=1.0)
    z = torch.zeros(2, 30)
    z[0, 0], z[1, 1] = 1e-3, 1e-3  # nearly the same latent, different class
    images = generator(z)
    assert (images[0] - images[1]).abs().max() > 1e-2


def test_projection_discriminator_needs_labels_exactly_when_conditional():
    discriminator = Discriminator(COND)
    x = torch.randn(3, 3, 32, 32)
    assert discriminator(x, torch.tensor([0, 5, 23])).shape == (3,)
    with pytest.raises(ValueError, match="labels"):
        discriminator(x)
    with pytest.raises(ValueError, match="labels"):
        Discriminator(TINY)(x, torch.tensor([0, 1, 2]))


def test_class_projection_changes_the_logit():
    discriminator = Discriminator(COND).eval()
    x = torch.randn(1, 3, 32, 32)
    assert discriminator(x, torch.tensor([0])).item() != discriminator(x, torch.tensor([1])).item()


LATENT = GANConfig(
    z_dim=30,
    g_channels=(16, 8),
    d_channels=(8,),
    n_classes=24,
    space="latent",
    vae_block_out_channels=(8, 16, 16),
    vae_norm_groups=4,
    vae_scaling_factor=0.5,
)


def test_latent_generator_draws_latents_and_renders_them_with_the_frozen_decoder():
    from genserve.shared.blocks.autoencoder import VAE

    generator = Generator(LATENT).eval()
    vae = VAE(LATENT.vae_config()).eval()
    generator.decoder.load_state_dict(vae.decoder.state_dict())
    generator.post_quant_conv.load_state_dict(vae.post_quant_conv.state_dict())
    z = torch.randn(3, 30)
    latents = generator.features(z)
    assert latents.shape == (3, 4, 8, 8)
    expected = vae.decode(latents / LATENT.vae_scaling_factor).clamp(-1, 1)
    torch.testing.assert_close(generator(z), expected)
    assert not any(p.requires_grad for p in generator.decoder.parameters())


def test_latent_discriminator_judges_latents():
    assert Discriminator(LATENT)(torch.randn(2, 4, 8, 8), torch.tensor([0, 1])).shape == (2,)


def test_latent_generator_gradients_reach_its_first_layer_but_not_the_decoder():
    generator = Generator(LATENT)
    generator(torch.randn(4, 30)).mean().backward()
    assert generator.project.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in generator.decoder.parameters())
