"""Mixture-of-experts feedforward (Remark 18, "Mixture-of-Experts", of the chapter "Deep Learning Building Blocks"): a
learned router sends each token to its top-k of E SwiGLU experts and mixes their outputs by the router weights; optional
shared experts see every token (DeepSeekMoE).

Two routers, as the served families use them:
- "softmax" (Mixtral, Qwen3-MoE, gpt-oss): p = softmax(x W_r + b_r), the k largest, renormalised to sum 1 unless
  `normalize_topk` is off;
- "sigmoid_grouped" (DeepSeek-V3, "auxiliary-loss-free load balancing"): s = sigmoid(x W_r); experts are chosen by
  s + b (the correction bias `gate.e_score_correction_bias`) among the `topk_groups` groups whose two best experts
  score highest, weighted by s itself (renormalised when `normalize_topk`) times `routed_scaling`.

Experts run grouped: the (token, slot) pairs are sorted by expert and each expert that received tokens runs one
product over all of its rows; there is no loop over tokens.

The load-balancing auxiliary loss is Switch Transformer's E * sum_e f_e P_e (f_e: fraction of routed slots that go
to expert e, P_e: mean router probability of e). It equals 1 for uniform routing and grows towards E as routing
collapses onto one expert; `aux_loss` holds the value from the latest forward for the training loop to add.
"""

from __future__ import annotations

import torch
from torch import nn

from genserve.shared.blocks.backend import Backend
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
        *,
        router: str = "softmax",
        router_bias: bool = False,
        expert_bias: bool = False,
        activation: str = "silu",
        alpha: float = 1.702,
        limit: float = 7.0,
        shared_hidden_dim: int | None = None,
        n_groups: int = 1,
        topk_groups: int = 1,
        routed_scaling: float = 1.0,
        backend: Backend | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        if n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {n_shared_experts}")
        if router not in ("softmax", "sigmoid_grouped"):
            raise ValueError(f"router must be 'softmax' or 'sigmoid_grouped', got {router!r}")
        if n_experts % n_groups or not 1 <= topk_groups <= n_groups:
            raise ValueError(f"n_groups ({n_groups}) must divide n_experts ({n_experts}) and topk_groups be in "
                             "[1, n_groups]")
        self.n_experts, self.top_k, self.normalize_topk = n_experts, top_k, normalize_topk
        self.router, self.n_groups, self.topk_groups = router, n_groups, topk_groups
        self.routed_scaling = routed_scaling
        self.gate = nn.Linear(dim, n_experts, bias=router_bias)
        if router == "sigmoid_grouped":
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(n_experts))

        def expert(hidden: int | None) -> SwiGLU:
            return SwiGLU(dim, hidden, bias=expert_bias, backend=backend, activation=activation, alpha=alpha,
                          limit=limit)

        self.backend = backend
        self.experts = nn.ModuleList(expert(hidden_dim) for _ in range(n_experts))
        self.shared_experts = nn.ModuleList(expert(shared_hidden_dim or hidden_dim) for _ in range(n_shared_experts))
        self.aux_loss = torch.zeros(())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, dim) -> (router probs or scores (N, E), top-k weights (N, k), top-k expert indices (N, k))."""
        logits = nn.functional.linear(x.float(), self.gate.weight.float(),
                                      None if self.gate.bias is None else self.gate.bias.float())
        if self.router == "sigmoid_grouped":
            return self._route_grouped(logits.sigmoid())
        probs = torch.softmax(logits, dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        if self.normalize_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, idx

    def _route_grouped(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's choice (module docstring): groups ranked by the sum of their two best biased scores."""
        n, g = scores.shape[0], self.n_groups
        biased = scores + self.gate.e_score_correction_bias.float()
        group_scores = biased.view(n, g, -1).topk(min(2, self.n_experts // g), dim=-1).values.sum(-1)  # (N, G)
        groups = group_scores.topk(self.topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        biased = biased.masked_fill(~keep.repeat_interleave(self.n_experts // g, dim=1), float("-inf"))
        idx = biased.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, idx)
        if self.normalize_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, weights * self.routed_scaling, idx

    @property
    def fusable(self) -> bool:
        """Experts a fused kernel computes: SiLU-gated, without biases, with dense weights."""
        first = self.experts[0]
        return (first.activation == "silu" and first.gate_proj.bias is None
                and isinstance(getattr(first.gate_proj, "weight", None), torch.Tensor)
                and first.gate_proj.weight.dim() == 2)  # not the blocks of a GGUF file's kept-quantized experts

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[W_gate; W_up] (E, 2I, dim) and W_down (E, dim, I), stacked on first use; the experts' weights become views
        into them (module docstring)."""
        first = self.experts[0].gate_proj.weight
        if getattr(self, "_stacked_key", None) != first.data_ptr():
            gate_up = torch.stack([torch.cat((e.gate_proj.weight.data, e.up_proj.weight.data)) for e in self.experts])
            down = torch.stack([e.down_proj.weight.data for e in self.experts])
            inter = gate_up.shape[1] // 2
            for i, e in enumerate(self.experts):
                e.gate_proj.weight.data, e.up_proj.weight.data = gate_up[i, :inter], gate_up[i, inter:]
                e.down_proj.weight.data = down[i]
            self._stacked = gate_up, down
            self._stacked_key = self.experts[0].gate_proj.weight.data_ptr()
        return self._stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, dim)
        probs, weights, idx = self.route(x)
        fused = self.backend.experts(x, self, weights, idx) if self.backend is not None else None
        if fused is not None:
            for expert in self.shared_experts:
                fused = fused + expert(x)
            return fused.reshape(shape)
        flat = idx.reshape(-1)  # (N k,): slot j of token t is entry t k + j
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        tokens = order // self.top_k
        rows_in = x[tokens]  # (N k, dim): every (token, slot) row, grouped by expert, in one gather
        rows_out = torch.empty_like(rows_in)
        start = 0
        for e, count in enumerate(counts):  # one product per expert that received tokens
            if count:
                rows_out[start:start + count] = self.experts[e](rows_in[start:start + count])
                start += count
        rows_out.mul_(weights.reshape(-1)[order, None].to(x.dtype))
        out = torch.zeros_like(x).index_add_(0, tokens, rows_out)  # one scatter back to the tokens
        for expert in self.shared_experts:
            out = out + expert(x)
        if self.training:
            self.aux_loss = load_balancing_loss(probs, idx, self.n_experts)
        return out.reshape(shape)
