"""genserve.kernels.fused_moe against the experts computed one by one in torch: every expert's rows in whole tiles
(padding rows never written), experts that receive no token, and the routing weights applied per (token, slot)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genserve.kernels.fused_moe import BLOCK_M, align, fused_moe


def _reference(x, w_gate_up, w_down, weights, ids) -> torch.Tensor:
    inter = w_down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (x[t] @ w_gate_up[e].T).split(inter)
            out[t] += weights[t, j] * ((F.silu(gate) * up) @ w_down[e].T)
    return out


def test_align_pads_each_expert_to_whole_tiles() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [2, 0]])  # expert 1 gets nothing
    rows, experts = align(ids, 4)
    assert experts[:3].tolist() == [0, 2, 3]  # one tile each for the experts that received pairs
    assert rows.numel() == experts.numel() * BLOCK_M
    for tile, e in enumerate(experts[:3].tolist()):
        pairs = [p for p in rows[tile * BLOCK_M:(tile + 1) * BLOCK_M].tolist() if p < ids.numel()]
        assert sorted(pairs) == [p for p in range(ids.numel()) if ids.reshape(-1)[p] == e]
    assert (rows[3 * BLOCK_M:] == ids.numel()).all()  # the tiles past them: padding alone


@pytest.mark.parametrize(("n", "k", "n_experts"), [(1, 1, 1), (3, 2, 64), (64, 8, 128), (300, 2, 4)])
def test_align_has_room_for_every_routing_without_reading_the_device(n, k, n_experts) -> None:
    """Its sizes come from the shapes (no host read per MoE layer, issue 37, defect 8): on the meta device, whose
    tensors hold no values, it runs; and the bound holds for a routing that pads much (one pair for every expert but
    the first, the rest on it)."""
    rows, experts = align(torch.zeros(n, k, dtype=torch.long, device="meta"), n_experts)
    assert rows.device.type == "meta" and rows.numel() == experts.numel() * BLOCK_M
    worst = torch.zeros(n * k, dtype=torch.long)
    worst[:min(n_experts, n * k) - 1] = torch.arange(1, min(n_experts, n * k))
    worst = worst.view(n, k)
    real_tiles = sum(-(-int(c) // BLOCK_M) for c in torch.bincount(worst.flatten()))
    assert real_tiles <= align(worst, n_experts)[1].numel()


@pytest.mark.parametrize(("n", "k", "n_experts", "hidden", "inter"), [(5, 2, 4, 48, 40), (37, 3, 8, 64, 96)])
def test_fused_moe_matches_the_experts_one_by_one(n, k, n_experts, hidden, inter) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, hidden, generator=gen)
    w_gate_up = 0.1 * torch.randn(n_experts, 2 * inter, hidden, generator=gen)
    w_down = 0.1 * torch.randn(n_experts, hidden, inter, generator=gen)
    scores = torch.randn(n, n_experts, generator=gen).softmax(-1)
    weights, ids = scores.topk(k, dim=-1)
    out = fused_moe(x, w_gate_up, w_down, weights, ids)
    assert (out - _reference(x, w_gate_up, w_down, weights, ids)).abs().max().item() <= 2e-5


def test_fused_moe_refuses_mismatched_weights() -> None:
    with pytest.raises(ValueError, match="w_down"):
        fused_moe(torch.randn(2, 8), torch.randn(2, 6, 8), torch.randn(2, 8, 4), torch.ones(2, 1),
                  torch.zeros(2, 1, dtype=torch.long))
