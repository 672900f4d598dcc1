"""Convolutions on oneDNN with the weight reordered once (kernels/cpu_conv.py) against F.conv2d."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from genserve.kernels import cpu_conv
from genserve.shared.blocks.conv import Conv2d

pytestmark = pytest.mark.skipif(not cpu_conv._available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize(("shape", "out_ch", "k", "stride", "padding"), [
    ((2, 64, 8, 8), 64, 3, 1, 1), ((2, 32, 9, 7), 32, 3, 2, 1), ((2, 96, 6, 6), 48, 1, 1, 0),
    ((3, 24, 6, 6), 24, 3, 1, 0)])
@pytest.mark.parametrize("bias", [True, False])
def test_prepared_conv_matches_conv2d(shape, out_ch, k, stride, padding, bias):
    gen = torch.Generator().manual_seed(out_ch)
    x = torch.randn(*shape, generator=gen)
    w, b = torch.randn(out_ch, shape[1], k, k, generator=gen), torch.randn(out_ch, generator=gen) if bias else None
    assert cpu_conv.supports(x, w, (stride, stride), (padding, padding))
    cache = {}
    for inp in (x, x.contiguous(memory_format=torch.channels_last)):
        out = cpu_conv.conv2d(inp, w, b, (stride, stride), (padding, padding), cache)
        torch.testing.assert_close(out, F.conv2d(x, w, b, stride, padding), atol=1e-4, rtol=1e-5)


def test_the_path_follows_one_image_size_and_dtype_never_the_batch_size():
    w = torch.randn(8, 8, 3, 3)
    for batch in (1, 2, 4, 64):
        assert cpu_conv.supports(torch.randn(batch, 8, 16, 22), w, (1, 1), (1, 1))  # 352 output pixels per image
        assert not cpu_conv.supports(torch.randn(batch, 8, 32, 32), w, (1, 1), (1, 1))  # 1024
    assert not cpu_conv.supports(torch.randn(2, 8, 16, 16, dtype=torch.bfloat16), w.bfloat16(), (1, 1), (1, 1))
    x = torch.randn(2, 64, 4, 4)
    with torch.inference_mode():
        assert not cpu_conv.supports(x, torch.randn(64, 64, 3, 3), (1, 1), (1, 1))  # cannot track versions


@pytest.mark.parametrize(("size", "k"), [(8, 3), (8, 1), (32, 3), (32, 1)])  # prepared and unprepared paths
def test_an_image_is_bit_identical_alone_and_in_any_batch(size, k):
    """What lets the image apps batch requests: no batch size or position changes an image's bits."""
    torch.manual_seed(size + k)
    conv, x = Conv2d(24, 16, k, padding=k // 2), torch.randn(33, 24, size, size)
    with torch.inference_mode():
        whole = conv(x)
        for n in (1, 2, 3, 4, 15, 16, 17):
            assert torch.equal(conv(x[:n]), whole[:n])
        order = torch.randperm(33)
        assert torch.equal(conv(x[order]), whole[order])


def test_module_sees_in_place_weight_updates_and_copies_without_its_cache():
    torch.manual_seed(0)
    conv, x = Conv2d(32, 24, 3, padding=1), torch.randn(2, 32, 4, 4)
    with torch.no_grad():
        first = conv(x)
        assert conv.prepared  # the CPU inference path kept a reordered weight
        conv.weight.mul_(2.0)  # e.g. load_state_dict: same storage, new version
        torch.testing.assert_close(conv(x), F.conv2d(x, conv.weight, conv.bias, padding=1), atol=1e-4, rtol=1e-5)
    assert not torch.allclose(first, conv(x).detach())
    for clone in (copy.deepcopy(conv), pickle.loads(pickle.dumps(conv))):  # oneDNN tensors can be neither
        assert not clone.prepared
        torch.testing.assert_close(clone(x), conv(x), atol=1e-4, rtol=1e-5)


def test_training_keeps_autograd():
    conv, x = Conv2d(32, 24, 3, padding=1), torch.randn(2, 32, 4, 4, requires_grad=True)
    conv(x).sum().backward()
    assert x.grad is not None and conv.weight.grad is not None and not conv.prepared
