"""The residual block (Def. 9, "Residual Block", of the chapter "Deep Learning Building Blocks") with GroupNorm, SiLU,
dropout and timestep injection."""

from __future__ import annotations

import pytest
import torch

from genserve.shared.blocks.residual import ResBlock


def test_identity_skip_when_the_residual_branch_is_zero() -> None:
    """a_out = a_in + F(a_in): with F's last conv zeroed the block is the identity."""
    block = ResBlock(16, 16, temb_dim=8, groups=4)
    with torch.no_grad():
        block.conv2.weight.zero_()
        block.conv2.bias.zero_()
    x = torch.randn(2, 16, 6, 6)
    assert torch.equal(block(x, torch.randn(2, 8)), x)
    assert block.conv_shortcut is None


def test_channel_change_uses_a_1x1_shortcut_and_time_embedding_matters() -> None:
    block = ResBlock(8, 16, temb_dim=12, groups=4)
    assert block.conv_shortcut.kernel_size == (1, 1)
    x = torch.randn(2, 8, 5, 5)
    t1, t2 = torch.randn(2, 12), torch.randn(2, 12)
    y1, y2 = block(x, t1), block(x, t2)
    assert y1.shape == (2, 16, 5, 5)
    assert not torch.allclose(y1, y2)
    with pytest.raises(ValueError, match="temb"):
        block(x)


def test_gradient_reaches_the_input_through_the_skip() -> None:
    block = ResBlock(8, 8, groups=4)
    x = torch.randn(1, 8, 4, 4, requires_grad=True)
    block(x).sum().backward()
    assert x.grad.abs().sum() > 0


def test_matches_diffusers_resnet_block() -> None:
    from diffusers.models import resnet
    for in_ch, out_ch in ((8, 8), (8, 16)):
        ref = resnet.ResnetBlock2D(in_channels=in_ch, out_channels=out_ch, temb_channels=12, groups=4, eps=1e-6).eval()
        ours = ResBlock(in_ch, out_ch, temb_dim=12, groups=4, eps=1e-6).eval()
        ours.load_state_dict(ref.state_dict())
        x, temb = torch.randn(2, in_ch, 6, 6), torch.randn(2, 12)
        assert torch.allclose(ours(x, temb), ref(x, temb), atol=1e-5)
