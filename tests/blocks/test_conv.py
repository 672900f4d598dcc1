"""Convolution arithmetic (Example 1, "Convolution Arithmetic", and Exercises 5 and 6 of the chapter
"Deep Learning Building Blocks"), up/down-sampling and pooling."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from genserve.shared.blocks.backend import get_backend
from genserve.shared.blocks.conv import (
    Conv2d,
    Downsample,
    Upsample,
    conv2d_same,
    conv_out,
    conv_transpose,
    has_checkerboard_risk,
    pool,
    transposed_conv_out,
)


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_example_1_same_conv_has_1792_parameters() -> None:
    conv = conv2d_same(3, 64, 3)
    assert _n_params(conv) == 64 * 3 * 3 * 3 + 64 == 1792
    assert conv(torch.randn(1, 3, 32, 32)).shape == (1, 64, 32, 32)
    assert _n_params(nn.Linear(3 * 32 * 32, 64, bias=False)) == 196_608  # the chapter's fully connected comparison


def test_exercise_5_strided_conv_arithmetic() -> None:
    """C_in = 3, C_out = 64, 3x3, stride 2, no bias, 64x64 input."""
    conv = nn.Conv2d(3, 64, 3, stride=2, padding=1, bias=False)
    assert _n_params(conv) == 1728  # (a)
    assert conv_out(64, 3, 2, 1) == 32 and conv(torch.randn(1, 3, 64, 64)).shape[-2:] == (32, 32)  # (b), padding 1
    assert conv_out(64, 3, 2, 0) == 31 == nn.Conv2d(3, 64, 3, 2)(torch.randn(1, 3, 64, 64)).shape[-1]  # unpadded
    assert (3 * 64 * 64) * (64 * 32 * 32) == 805_306_368  # (c) a dense map between the same sizes
    assert _n_params(conv2d_same(3, 64, 3, stride=2, bias=False)) == 1728


def test_exercise_6_transposed_conv_doubles_16_to_32() -> None:
    up = conv_transpose(8, 4, kernel_size=4, stride=2, padding=1)
    assert transposed_conv_out(16, 4, 2, 1) == 32
    assert up(torch.randn(1, 8, 16, 16)).shape == (1, 4, 32, 32)
    # the transposed rule inverts the forward rule: a 4/2/1 conv maps 32 back to 16
    assert conv_out(32, 4, 2, 1) == 16
    for n, k, s, p in [(7, 3, 2, 1), (5, 5, 3, 2), (9, 4, 1, 0)]:
        t = nn.ConvTranspose2d(1, 1, k, s, p)(torch.randn(1, 1, n, n))
        assert t.shape[-1] == transposed_conv_out(n, k, s, p)


def test_checkerboard_rule_of_remark_4() -> None:
    assert has_checkerboard_risk(3, 2) and not has_checkerboard_risk(4, 2)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_the_blocks_transposed_conv_is_the_adjoint_of_their_conv(backend: str) -> None:
    """Def. 8 ("Transposed Convolution"): <conv(x), y> = <x, conv^T(y)> for the same kernel, with genserve's Conv2d
    (through each backend, the CPU's prepared oneDNN path included) and the GAN generator's conv_transpose."""
    conv = Conv2d(3, 4, 4, stride=2, padding=1, bias=False, backend=get_backend(backend))
    up = conv_transpose(4, 3, kernel_size=4, stride=2, padding=1, bias=False)
    with torch.no_grad():
        up.weight.copy_(conv.weight)
        x, y = torch.randn(1, 3, 16, 16), torch.randn(1, 4, 8, 8)
        lhs = (conv(x) * y).sum()
        rhs = (x * up(y)).sum()
    torch.testing.assert_close(lhs, rhs, rtol=1e-4, atol=1e-4)


def test_downsample_and_upsample_shapes_and_names() -> None:
    x = torch.randn(2, 8, 16, 16)
    assert Downsample(8, 16)(x).shape == (2, 16, 8, 8)
    assert Downsample(8, padding=0)(x).shape == (2, 8, 8, 8)
    assert Upsample(8)(x).shape == (2, 8, 32, 32)
    assert set(Upsample(8).state_dict()) == {"conv.weight", "conv.bias"}
    assert set(Downsample(8).state_dict()) == {"conv.weight", "conv.bias"}


def test_upsample_is_nearest_then_conv() -> None:
    up = Upsample(2)
    with torch.no_grad():  # an identity 3x3 kernel leaves the nearest-neighbour upsampling visible
        up.conv.weight.zero_()
        up.conv.bias.zero_()
        for c in range(2):
            up.conv.weight[c, c, 1, 1] = 1.0
    x = torch.arange(8.0).view(1, 2, 2, 2)
    assert torch.equal(up(x), x.repeat_interleave(2, -1).repeat_interleave(2, -2))


def test_downsample_matches_diffusers() -> None:
    from diffusers.models import downsampling as diffusers
    for padding in (1, 0):
        ref = diffusers.Downsample2D(8, use_conv=True, out_channels=8, padding=padding)
        ours = Downsample(8, padding=padding)
        # diffusers registers the same conv twice, as `conv` and the legacy alias `Conv2d_0`
        ours.load_state_dict({k: v for k, v in ref.state_dict().items() if k.startswith("conv.")})
        x = torch.randn(1, 8, 9, 9)
        assert torch.allclose(ours(x), ref(x), atol=1e-6)


def test_pooling() -> None:
    x = torch.arange(16.0).view(1, 1, 4, 4)
    assert torch.equal(pool("max")(x), torch.tensor([[[[5.0, 7.0], [13.0, 15.0]]]]))
    assert torch.equal(pool("avg")(x), torch.tensor([[[[2.5, 4.5], [10.5, 12.5]]]]))
    assert torch.equal(pool("global_avg")(x), torch.full((1, 1, 1, 1), 7.5))
    with pytest.raises(ValueError, match="unknown pooling"):
        pool("median")
    with pytest.raises(ValueError, match="odd"):
        conv2d_same(3, 3, 4)
