"""Mixture-of-experts feedforward (Remark 18, "Mixture-of-Experts", of the chapter "Deep Learning Building Blocks"): a
learned router sends each token to its top-k of E SwiGLU experts and mixes their outputs by the router weights; optional
shared experts see every token (DeepSeekMoE).

The load-balancing auxiliary loss is Switch Transformer's E * sum_e f_e P_e (f_e: fraction of routed slots that go
to expert e, P_e: mean router probability of e). It equals 1 for uniform routing and grows towards E as routing
collapses onto one expert; `aux_loss` holds the value from the latest forward for the training loop to add.
"""

from __future__ import annotations

import torch
from torch import nn

from genserve.shared.blocks.ffn import SwiGLU


def load_balancing_loss(probs: torch.Tensor, topk_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """probs (N, E) router probabilities, topk_idx (N, k) chosen experts -> E * sum_e f_e P_e (a scalar)."""
    counts = torch.zeros(n_experts, device=probs.device).index_add_(
        0, topk_idx.reshape(-1), torch.ones(topk_idx.numel(), device=probs.device)
    )
    f = counts / topk_idx.numel()
    return n_experts * (f * probs.mean(dim=0)).sum()


class MoE(nn.Module):
    """x (..., dim) -> (..., dim). Router `gate` (Mixtral's name), `experts`, optional `shared_experts`."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        hidden_dim: int | None = None,
        n_shared_experts: int = 0,
        normalize_topk: bool = True,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        if n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {n_shared_experts}")
        self.n_experts, self.top_k, self.normalize_topk = n_experts, top_k, normalize_topk
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(dim, hidden_dim) for _ in range(n_experts))
        self.shared_experts = nn.ModuleList(SwiGLU(dim, hidden_dim) for _ in range(n_shared_experts))
        self.aux_loss = torch.zeros(())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, dim) -> (router probs (N, E), top-k weights (N, k), top-k expert indices (N, k))."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        if self.normalize_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, dim)
        probs, weights, idx = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(idx == e)  # tokens that picked expert e, and in which of their k slots
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None].to(x.dtype))
        for expert in self.shared_experts:
            out = out + expert(x)
        self.aux_loss = load_balancing_loss(probs, idx, self.n_experts)
        return out.reshape(shape)
