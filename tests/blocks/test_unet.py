"""The generic U-Net: shape round trip at several resolutions, gradient flow, text conditioning, and diffusers'
UNet2DConditionModel's outputs from its own weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from genserve.shared.blocks.cross_attention import ContextCache
from genserve.shared.blocks.unet import UNet, UNetConfig

SMALL = UNetConfig(block_out_channels=(16, 32, 32), layers_per_block=1, attention_levels=(1, 2),
                   cross_attention_dim=24, head_dim=8, norm_groups=8)


@pytest.mark.parametrize("hw", [(8, 8), (16, 16), (32, 32), (8, 24)])
def test_output_shape_equals_input_shape(hw: tuple[int, int]) -> None:
    model = UNet(SMALL).eval()
    x = torch.randn(2, 4, *hw)
    out = model(x, torch.tensor([1, 700]), torch.randn(2, 5, 24))
    assert out.shape == x.shape


def test_self_attention_only_unet_with_two_layers_per_block() -> None:
    config = UNetConfig(in_channels=3, out_channels=6, block_out_channels=(8, 16), layers_per_block=2,
                        attention_levels=(0, 1), cross_attention_dim=None, head_dim=8, norm_groups=4)
    out = UNet(config)(torch.randn(3, 3, 16, 16), torch.tensor(10))
    assert out.shape == (3, 6, 16, 16)


def test_gradients_reach_the_first_layer() -> None:
    model = UNet(SMALL)
    out = model(torch.randn(2, 4, 8, 8), torch.tensor([5, 50]), torch.randn(2, 3, 24))
    out.square().mean().backward()
    for name in ("conv_in.weight", "time_embedding.linear_1.weight",
                 "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_cross_attention_context_changes_the_output() -> None:
    model = UNet(SMALL).eval()
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([100, 100])
    with torch.no_grad():
        ctx_a = torch.randn(2, 4, 24)
        a = model(x, t, ctx_a)
        b = model(x, t, torch.randn(2, 4, 24))
        a_again = model(x, t, ctx_a)
    torch.testing.assert_close(a, a_again, rtol=0, atol=0)
    assert (a - b).abs().max() > 1e-3


def test_context_cache_gives_the_same_output_at_every_timestep() -> None:
    """One cache reused across several denoising calls equals passing the raw context each time."""
    model = UNet(SMALL).eval()
    ctx = torch.randn(2, 5, 24)
    cache = ContextCache(ctx)
    with torch.no_grad():
        for t in (999, 500, 1):
            x, timesteps = torch.randn(2, 4, 8, 8), torch.tensor([t, t])
            torch.testing.assert_close(model(x, timesteps, cache), model(x, timesteps, ctx), rtol=1e-5, atol=1e-5)


def test_timestep_changes_the_output() -> None:
    model = UNet(SMALL).eval()
    x, ctx = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 24)
    with torch.no_grad():
        assert (model(x, torch.tensor([1]), ctx) - model(x, torch.tensor([900]), ctx)).abs().max() > 1e-3


def test_sizes_the_levels_cannot_halve_round_up_and_come_back() -> None:
    """6×10 halves to 3×5, then 2×3 (rounded up, as diffusers' stride-2 convs do); each upsample then aims at the
    size of the skip it meets, so the output is 6×10 again."""
    out = UNet(SMALL).eval()(torch.randn(1, 4, 6, 10), torch.tensor([1]), torch.randn(1, 2, 24))
    assert out.shape == (1, 4, 6, 10)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"block_out_channels": (16, 20)}, "norm_groups"),
    ({"attention_levels": (3,)}, "attention_levels"),
    ({"head_dim": 12}, "head_dim"),
    ({"layers_per_block": 0}, "layers_per_block"),
])
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    base = dict(block_out_channels=(16, 32), attention_levels=(1,), head_dim=8, norm_groups=8)
    with pytest.raises(ValueError, match=field):
        UNetConfig(**{**base, **kwargs})


@pytest.mark.parametrize("heads", [None, (2, 4, 8)])
def test_geglu_unet_gives_diffusers_unet2dcondition_outputs_with_its_weights(heads) -> None:
    """Values, not names: diffusers' UNet2DConditionModel (linear projections, GEGLU, norm_eps 1e-5) loads into our
    UNet as it is and gives the same output, with one head width everywhere or a head count per level."""
    from diffusers import UNet2DConditionModel

    config = dataclasses.replace(SMALL, ff="geglu", resnet_eps=1e-5, attention_heads=heads)
    chs = config.block_out_channels
    down = tuple("CrossAttnDownBlock2D" if i in config.attention_levels else "DownBlock2D" for i in range(len(chs)))
    up = tuple("CrossAttnUpBlock2D" if i in config.attention_levels else "UpBlock2D"
               for i in reversed(range(len(chs))))
    torch.manual_seed(0)
    ref = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=chs, down_block_types=down,
        up_block_types=up, layers_per_block=config.layers_per_block, cross_attention_dim=config.cross_attention_dim,
        attention_head_dim=heads or tuple(c // config.head_dim for c in chs), norm_num_groups=config.norm_groups,
        use_linear_projection=True,
    ).eval()
    ours = UNet(config).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    x, t, ctx = torch.randn(2, 4, 8, 16), torch.tensor([999, 20]), torch.randn(2, 5, 24)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, t, ctx), ref(x, t, encoder_hidden_states=ctx).sample, rtol=1e-4, atol=1e-4)
