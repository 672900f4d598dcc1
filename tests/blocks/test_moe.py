"""Mixture of experts (Remark 18, "Mixture-of-Experts", of the chapter "Deep Learning Building Blocks"): top-k routing,
shared experts, load-balancing loss."""

from __future__ import annotations

import pytest
import torch

from genserve.shared.blocks.moe import MoE, load_balancing_loss


def test_every_token_goes_to_exactly_k_experts() -> None:
    moe = MoE(16, n_experts=6, top_k=2, hidden_dim=8)
    x = torch.randn(20, 16)
    received: dict[int, torch.Tensor] = {}
    for e, expert in enumerate(moe.experts):
        expert.register_forward_pre_hook(lambda m, args, e=e: received.__setitem__(e, args[0].detach().clone()))
    moe(x)
    visits = torch.zeros(20, dtype=torch.long)
    _, _, idx = moe.route(x)
    for e, rows in received.items():
        tokens = (rows[:, None, :] == x[None]).all(-1).nonzero()[:, 1]  # which tokens expert e saw
        assert torch.equal(tokens.sort().values, (idx == e).any(-1).nonzero()[:, 0])
        visits[tokens] += 1
    assert torch.equal(visits, torch.full((20,), 2))


def test_output_is_the_router_weighted_mix_of_the_chosen_experts() -> None:
    moe = MoE(8, n_experts=4, top_k=2, hidden_dim=8)
    x = torch.randn(5, 8)
    probs, weights, idx = moe.route(x)
    assert torch.allclose(weights.sum(-1), torch.ones(5))
    assert torch.equal(idx, probs.topk(2, dim=-1).indices)
    expected = torch.stack([sum(weights[t, j] * moe.experts[int(idx[t, j])](x[t]) for j in range(2)) for t in range(5)])
    assert torch.allclose(moe(x), expected, atol=1e-6)


def test_shared_experts_are_always_on() -> None:
    moe = MoE(8, n_experts=4, top_k=1, hidden_dim=8, n_shared_experts=1)
    x = torch.randn(3, 8)
    routed = MoE(8, n_experts=4, top_k=1, hidden_dim=8)
    routed.load_state_dict(moe.state_dict(), strict=False)
    assert torch.allclose(moe(x), routed(x) + moe.shared_experts[0](x), atol=1e-6)


def test_aux_loss_is_minimal_for_uniform_routing() -> None:
    """E * sum_e f_e P_e equals 1 when router probabilities are uniform and grows to E when one expert takes all."""
    n_experts, n_tokens, k = 4, 64, 1
    uniform = torch.full((n_tokens, n_experts), 1 / n_experts)
    balanced_idx = torch.arange(n_tokens)[:, None] % n_experts
    assert load_balancing_loss(uniform, balanced_idx, n_experts) == pytest.approx(1.0)
    collapsed = torch.zeros(n_tokens, n_experts)
    collapsed[:, 0] = 1.0
    assert load_balancing_loss(collapsed, torch.zeros(n_tokens, k, dtype=torch.long), n_experts) == pytest.approx(4.0)
    skewed = torch.softmax(torch.randn(n_tokens, n_experts) + torch.tensor([2.0, 0, 0, 0]), dim=-1)
    assert load_balancing_loss(skewed, skewed.topk(k).indices, n_experts) > 1.0

    moe = MoE(8, n_experts=4, top_k=2, hidden_dim=8)
    with torch.no_grad():
        moe.gate.weight.zero_()  # a router with no preference: P_e = 1/E for every token
    moe(torch.randn(10, 8))
    assert moe.aux_loss.item() == pytest.approx(1.0)


def test_aux_loss_trains_the_router() -> None:
    moe = MoE(8, n_experts=4, top_k=2, hidden_dim=8)
    moe(torch.randn(10, 8))
    moe.aux_loss.backward()
    assert moe.gate.weight.grad.abs().sum() > 0


def test_top_k_validation() -> None:
    with pytest.raises(ValueError, match="top_k"):
        MoE(8, n_experts=2, top_k=3)
