"""Feedforward blocks: the MLP of Def. 1 ("Feedforward Neural Network") of the chapter "Deep Learning Building Blocks"
(with the forward and backward pass of the chapter's Exercise 1), GELU FFN, SwiGLU (Def. 20, "SwiGLU") and its
hidden-size rule (Remark 15, "SwiGLU in Practice"), and the activation factory (Def. 2,
"Common Activation Functions")."""

from __future__ import annotations

import math

import pytest
import torch

from genserve.shared.blocks.activations import ACTIVATION_NAMES, activation
from genserve.shared.blocks.ffn import MLP, GeluFFN, SwiGLU, swiglu_hidden_dim


def test_exercise_1_forward_and_backward_pass() -> None:
    """x = [1, -1], W1 = [[2, -1], [1, 1]], W2 = [1, -1], ReLU, no bias: z1 = [3, 0], y = 3, dy/dW2 = a1 = [3, 0]."""
    mlp = MLP([2, 2, 1], act="relu", bias=False)
    with torch.no_grad():
        mlp.layers[0].weight.copy_(torch.tensor([[2.0, -1.0], [1.0, 1.0]]))
        mlp.layers[1].weight.copy_(torch.tensor([[1.0, -1.0]]))
    y = mlp(torch.tensor([1.0, -1.0]))
    assert torch.equal(y, torch.tensor([3.0]))
    y.sum().backward()
    assert torch.equal(mlp.layers[1].weight.grad, torch.tensor([[3.0, 0.0]]))


def test_mlp_alternates_affine_maps_and_activations() -> None:
    mlp = MLP([3, 4, 4, 2], act="tanh", final_activation="sigmoid")
    x = torch.randn(5, 3)
    a = x
    for i, layer in enumerate(mlp.layers):
        z = a @ layer.weight.T + layer.bias
        a = torch.tanh(z) if i < 2 else torch.sigmoid(z)
    assert torch.allclose(mlp(x), a, atol=1e-6)
    assert sum(p.numel() for p in mlp.parameters()) == (3 * 4 + 4) + (4 * 4 + 4) + (4 * 2 + 2)


@pytest.mark.parametrize(
    ("dim", "hidden"),
    [(4096, 11008), (512, 1536), (768, 2048), (5120, 13824), (64, 256)],  # LLaMA-7B and -13B sizes among them
)
def test_swiglu_hidden_size_rule(dim: int, hidden: int) -> None:
    assert swiglu_hidden_dim(dim) == hidden
    assert hidden % 256 == 0 and hidden >= math.floor(2 / 3 * 4 * dim) > hidden - 256


def test_swiglu_definition_and_names() -> None:
    """SwiGLU(x) = (Swish(x W1) * (x V)) W2; W1 = gate_proj, V = up_proj, W2 = down_proj as in HF Llama."""
    ffn = SwiGLU(16, 40)
    x = torch.randn(3, 16)
    w1, v, w2 = ffn.gate_proj.weight, ffn.up_proj.weight, ffn.down_proj.weight
    a = x @ w1.T
    expected = ((a * torch.sigmoid(a)) * (x @ v.T)) @ w2.T
    assert torch.allclose(ffn(x), expected, atol=1e-6)
    assert set(ffn.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    assert SwiGLU(512).gate_proj.out_features == 1536


def test_swiglu_matches_transformers_llama_mlp() -> None:
    import transformers
    from transformers.models.llama.modeling_llama import LlamaMLP

    ref = LlamaMLP(transformers.LlamaConfig(hidden_size=32, intermediate_size=96, hidden_act="silu"))
    ours = SwiGLU(32, 96)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 32)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)


def test_gelu_ffn_is_w2_gelu_w1x_plus_b1_plus_b2() -> None:
    """The FFN of Algorithm 2 ("Transformer Encoder Block") with d_ff = 4d, against the formula in float64 with GELU
    written out as z * Phi(z)."""
    ffn = GeluFFN(8).double()
    x = torch.randn(2, 8, dtype=torch.float64)
    z = x @ ffn.fc1.weight.T + ffn.fc1.bias
    expected = (z * 0.5 * (1 + torch.erf(z / math.sqrt(2)))) @ ffn.fc2.weight.T + ffn.fc2.bias
    assert ffn.fc1.weight.shape == (32, 8)
    torch.testing.assert_close(ffn(x), expected, rtol=1e-12, atol=1e-12)


def test_activations_follow_definition_2() -> None:
    z = torch.linspace(-4, 4, 41, dtype=torch.float64)
    phi = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
    expected = {
        "sigmoid": 1 / (1 + torch.exp(-z)),
        "tanh": (torch.exp(z) - torch.exp(-z)) / (torch.exp(z) + torch.exp(-z)),
        "relu": torch.clamp(z, min=0),
        "leaky_relu": torch.maximum(0.01 * z, z),
        "gelu": z * phi,
        "gelu_tanh": 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3))),
        "quick_gelu": z / (1 + torch.exp(-1.702 * z)),
        "silu": z / (1 + torch.exp(-z)),
        "swish": z / (1 + torch.exp(-z)),
    }
    assert set(expected) == set(ACTIVATION_NAMES)
    for name, value in expected.items():
        assert torch.allclose(activation(name)(z), value, atol=1e-10), name
    assert torch.allclose(activation("gelu_tanh")(z), z * phi, atol=1e-3)  # the approximation is close to exact
    assert torch.allclose(activation("quick_gelu")(z), z * phi, atol=0.03)  # CLIP's sigmoid approximation
    assert torch.allclose(activation("leaky_relu", negative_slope=0.2)(z), torch.maximum(0.2 * z, z))
    with pytest.raises(ValueError, match="unknown activation"):
        activation("softplus")
