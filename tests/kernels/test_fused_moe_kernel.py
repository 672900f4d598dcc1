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
    assert experts.tolist() == [0, 2, 3]  # one tile each for the experts that received pairs
    assert rows.numel() == 3 * BLOCK_M
    for tile, e in enumerate(experts.tolist()):
        pairs = [p for p in rows[tile * BLOCK_M:(tile + 1) * BLOCK_M].tolist() if p < ids.numel()]
        assert sorted(pairs) == [p for p in range(ids.numel()) if ids.reshape(-1)[p] == e]


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
