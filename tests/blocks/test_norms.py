"""Normalisation layers of the chapter "Deep Learning Building Blocks" (Def. 5 "Batch Normalisation", Def. 6
"Layer Normalisation", Def. 19 "Root Mean Square Layer Normalisation") and the `norm` factory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from genserve.shared.blocks.backend import get_backend
from genserve.shared.blocks.norms import RMSNorm, group_norm, norm


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_rmsnorm_equals_torch_rmsnorm(backend: str) -> None:
    ours = RMSNorm(24, eps=1e-6, backend=get_backend(backend))
    ref = nn.RMSNorm(24, eps=1e-6)
    with torch.no_grad():
        w = torch.randn(24)
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    x = torch.randn(4, 7, 24) * 3
    assert torch.allclose(ours(x), ref(x), atol=1e-6)


def test_rmsnorm_definition_and_fused_residual() -> None:
    """RMSNorm(x) = x / sqrt(mean(x^2) + eps) * gamma (Def. 19, "Root Mean Square Layer Normalisation"): no
    mean-centring, unit RMS output."""
    n = RMSNorm(4, eps=0.0)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    expected = x / math.sqrt((1 + 4 + 9 + 16) / 4)
    assert torch.allclose(n(x), expected, atol=1e-7)
    assert torch.allclose(n(x + 10).pow(2).mean(), torch.tensor(1.0), atol=1e-6)
    r = torch.randn(1, 4)
    y, new_res = n(x, r)
    assert torch.equal(new_res, x + r)
    assert torch.allclose(y, n(x + r))
    assert [name for name, _ in n.named_parameters()] == ["weight"]


def test_exercise_4_layer_and_batch_statistics_through_group_norm() -> None:
    """The 4x3 activations of the chapter's Exercise 4 (gamma = 1, beta = 0, eps = 0) through genserve's GroupNorm:
    one group per sample is LayerNorm (row statistics), one group per channel over a batch laid out as space is
    BatchNorm (column statistics)."""
    x = torch.tensor([[1.0, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
    # LN: every row is (c, c+1, c+2): mean c+1, variance 2/3, so z = (-1, 0, 1) * sqrt(3/2)
    ln = group_norm(3, groups=1, eps=0.0, affine=False)
    expected_ln = torch.tensor([-1.0, 0.0, 1.0]).expand(4, 3) * math.sqrt(1.5)
    torch.testing.assert_close(ln(x[:, :, None, None])[:, :, 0, 0], expected_ln, atol=1e-6, rtol=0)
    # BN: each column is (c, c+3, c+6, c+9): mean c+4.5, population variance 11.25, z = (-3, -1, 1, 3) / sqrt(5)
    bn = group_norm(3, groups=3, eps=0.0, affine=False)
    columns = x.T.contiguous()[None, :, :, None]  # (1, C=3, H=4 samples, 1)
    expected_bn = torch.tensor([-3.0, -1.0, 1.0, 3.0])[:, None].expand(4, 3) / math.sqrt(5.0)
    torch.testing.assert_close(bn(columns)[0, :, :, 0].T, expected_bn, atol=1e-6, rtol=0)


def test_group_norm_normalises_groups_of_channels() -> None:
    gn = group_norm(8, groups=2, eps=0.0, affine=False)
    x = torch.randn(3, 8, 4, 4)
    y = gn(x).view(3, 2, -1)
    assert torch.allclose(y.mean(-1), torch.zeros(3, 2), atol=1e-5)
    assert torch.allclose(y.var(-1, unbiased=False), torch.ones(3, 2), atol=1e-4)
    with pytest.raises(ValueError, match="divide"):
        group_norm(10, groups=4)


@pytest.mark.parametrize("grad", [False, True])
def test_group_norm_with_silu_is_the_norm_then_silu(grad: bool) -> None:
    torch.manual_seed(0)
    gn, x = group_norm(16, groups=4), torch.randn(2, 16, 3, 5) * 2 + 1
    with torch.no_grad():
        gn.weight.normal_(), gn.bias.normal_()
    plain = nn.GroupNorm(4, 16, eps=gn.eps)
    plain.load_state_dict(gn.state_dict())  # same parameter names as nn.GroupNorm
    with torch.set_grad_enabled(grad):
        torch.testing.assert_close(gn(x, silu=True), F.silu(plain(x)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gn(x), plain(x), atol=1e-5, rtol=1e-5)


def test_norm_factory_names() -> None:
    assert isinstance(norm("rmsnorm", 8), RMSNorm)
    assert isinstance(norm("layernorm", 8), nn.LayerNorm)
    assert isinstance(norm("batchnorm", 8), nn.BatchNorm1d)
    assert isinstance(norm("batchnorm2d", 8), nn.BatchNorm2d)
    assert norm("groupnorm", 64).num_groups == 32
    with pytest.raises(ValueError, match="unknown norm"):
        norm("instancenorm", 8)
