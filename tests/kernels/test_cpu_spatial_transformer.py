"""The fused CPU spatial transformer (kernels/cpu_spatial_transformer.py) against the same block run op by op."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from genserve.kernels import cpu_spatial_transformer
from genserve.shared.blocks.backend import ReferenceBackend, TorchBackend
from genserve.shared.blocks.cross_attention import ContextCache
from genserve.shared.blocks.unet import SpatialTransformer


@pytest.fixture(autouse=True)
def _kernel(cpu_kernels) -> None:
    if not cpu_spatial_transformer.available():
        pytest.fail("the fused spatial transformer needs the BLAS sgemm that torch exports, and this torch has none")


def _block(channels: int = 64, head_dim: int = 32, context_dim: int | None = 24, groups: int = 8,
           seed: int = 0) -> SpatialTransformer:
    torch.manual_seed(seed)
    block = SpatialTransformer(channels, head_dim, context_dim, groups, backend=TorchBackend()).eval()
    with torch.no_grad():  # norms away from their identity init, so that a missed affine map shows
        for name, p in block.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    return block


def _reference(block: SpatialTransformer, x: torch.Tensor, context) -> torch.Tensor:
    twin = copy.deepcopy(block)
    twin.backend = ReferenceBackend()
    with torch.no_grad():
        return twin(x, context)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(("channels", "head_dim", "hw"), [(64, 32, (8, 8)), (128, 32, (4, 4)), (32, 16, (3, 5))])
def test_fused_block_matches_the_op_by_op_block(channels, head_dim, hw, channels_last):
    block = _block(channels, head_dim)
    x = torch.randn(2, channels, *hw)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    context = torch.randn(2, 7, 24)
    with torch.no_grad():
        fused = TorchBackend().spatial_transformer(x, block, ContextCache(context))
    assert fused is not None
    torch.testing.assert_close(fused, _reference(block, x, context), rtol=1e-5, atol=1e-5)


def test_fused_block_without_cross_attention():
    block = _block(context_dim=None)
    x = torch.randn(3, 64, 4, 4)
    with torch.no_grad():
        fused = block(x, None)
    assert block.prepared  # the fused path ran and kept its weights
    torch.testing.assert_close(fused, _reference(block, x, None), rtol=1e-5, atol=1e-5)


def test_fused_block_applies_query_key_value_biases():
    block = _block()
    attn = block.transformer_blocks[0].attn1
    for name in ("to_q", "to_k", "to_v"):
        layer = nn.Linear(64, 64)
        nn.init.normal_(layer.bias)
        setattr(attn, name, layer)
    x, context = torch.randn(2, 64, 4, 4), torch.randn(2, 5, 24)
    with torch.no_grad():
        fused = block(x, context)
    torch.testing.assert_close(fused, _reference(block, x, context), rtol=1e-5, atol=1e-5)


def test_fused_block_sees_an_in_place_weight_update():
    block = _block()
    x, context = torch.randn(2, 64, 4, 4), torch.randn(2, 5, 24)
    with torch.no_grad():
        before = block(x, context)
        block.transformer_blocks[0].ff.fc2.weight.mul_(-2.0)
        after = block(x, context)
    assert (after - before).abs().max() > 1e-2
    torch.testing.assert_close(after, _reference(block, x, context), rtol=1e-5, atol=1e-5)


def test_training_and_gradients_keep_the_op_by_op_block():
    block = _block()
    x, context = torch.randn(2, 64, 4, 4), torch.randn(2, 5, 24)
    assert TorchBackend().spatial_transformer(x, block, context) is None  # a gradient is needed
    block.train()
    with torch.no_grad():
        assert TorchBackend().spatial_transformer(x, block, context) is None
    block.eval()
    block(x, context).sum().backward()
    assert block.proj_in.weight.grad is not None and block.proj_in.weight.grad.abs().sum() > 0


def test_weights_created_under_inference_mode_are_never_prepared():
    with torch.inference_mode():
        block = _block()
        assert TorchBackend().spatial_transformer(torch.randn(2, 64, 4, 4), block, torch.randn(2, 5, 24)) is None


def test_a_copy_starts_without_the_prepared_weights():
    block = _block()
    with torch.no_grad():
        block(torch.randn(2, 64, 4, 4), torch.randn(2, 5, 24))
    assert block.prepared and not copy.deepcopy(block).prepared


def test_kernel_refuses_inputs_that_do_not_fit_the_block():
    block = _block()
    weights = cpu_spatial_transformer.BlockWeights(**block.kernel_weights())
    k = v = torch.randn(2, 5, 64)
    with pytest.raises(ValueError, match="channels"):
        cpu_spatial_transformer.spatial_transformer(weights, torch.randn(2, 32, 4, 4), k, v)
    with pytest.raises(ValueError, match="text keys and values"):
        cpu_spatial_transformer.spatial_transformer(weights, torch.randn(2, 64, 4, 4))
    with pytest.raises(ValueError, match="k_txt"):
        cpu_spatial_transformer.spatial_transformer(weights, torch.randn(3, 64, 4, 4), k, v)
    with pytest.raises(ValueError, match="groups"):
        cpu_spatial_transformer.BlockWeights(**{**block.kernel_weights(), "groups": 7})
