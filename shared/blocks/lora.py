"""Low-rank adaptation (Hu et al. 2021, "LoRA"): y = x W^T + s (x A^T) B^T, with A (r, in), B (out, r) and the scale
s = alpha / r (or alpha / sqrt(r), rsLoRA), for many adapters in one batch (Punica, Chen et al. 2023; S-LoRA, Sheng
et al. 2023): each group of rows gets its own adapter's delta in the same pass, the rows without one none.

``LoraStack`` holds one projection's adapters in fixed slots: A stacked (slots, R, in), B (slots, out, R) with the
scale folded into B (one multiply less in every kernel), both zero-padded to the largest rank R, and each slot's own
rank (0: the slot has nothing for this projection). The slots are allocated once, so a kernel (the fused CPU step, a
CUDA graph) may keep pointers into them while adapters come and go. ``LoraMapping`` says which slot each token of a
step uses (-1: the base model alone). ``lora_add`` is the delta in torch, one shrink and one expand product per group
of rows (Punica's SGMV); the backend (backend.py) routes it here or to the Triton kernels (kernels/lora.py).
"""

from __future__ import annotations

from functools import cached_property

import torch
from torch import nn


class LoraStack(nn.Module):
    """The adapters of one (in_features -> out_features) projection, in ``slots`` slots of rank up to ``max_rank``."""

    def __init__(self, slots: int, max_rank: int, in_features: int, out_features: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.in_features, self.out_features, self.max_rank = in_features, out_features, max_rank
        self.register_buffer("a", torch.zeros(slots, max_rank, in_features, dtype=dtype, device=device))
        self.register_buffer("b", torch.zeros(slots, out_features, max_rank, dtype=dtype, device=device))
        self.register_buffer("ranks", torch.zeros(slots, dtype=torch.int32, device=device))
        self.rank_list = [0] * slots  # the ranks on the host: the torch path reads them without a device sync

    def write(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put A (r, in) and the scaled B (out, r) into ``slot``, in place; None clears the slot."""
        with torch.no_grad():
            self.a[slot].zero_()
            self.b[slot].zero_()
            r = 0 if a is None else a.shape[0]
            if r:
                self.a[slot, :r].copy_(a)
                self.b[slot, :, :r].copy_(b)
            self.ranks[slot] = r
        self.rank_list[slot] = r


class LoraMapping:
    """The adapter slot of every token of a step: ``slots`` (N,) int32 on the model's device, -1 for none."""

    def __init__(self, slots: torch.Tensor):
        self.slots = slots

    @cached_property
    def groups(self) -> tuple[tuple[int, slice | torch.Tensor], ...]:
        """(slot, rows) per adapter in the step, rows a slice where they are contiguous (a prefill chunk, or the
        decode rows of one adapter), else an index tensor; computed once per step, shared by every projection."""
        host = self.slots.cpu()
        out = []
        for slot in host.unique().tolist():
            if slot < 0:
                continue
            rows = (host == slot).nonzero().flatten()
            first, last = int(rows[0]), int(rows[-1])
            out.append((slot, slice(first, last + 1) if last - first + 1 == rows.numel()
                        else rows.to(self.slots.device)))
        return tuple(out)


def lora_add(y: torch.Tensor, x: torch.Tensor, stack: LoraStack, mapping: LoraMapping) -> torch.Tensor:
    """y (N, out) += (x A_s^T) B_s^T for each slot s's rows of x (N, in), in place; returns y."""
    for slot, rows in mapping.groups:
        r = stack.rank_list[slot]
        if r == 0:
            continue
        a, b = stack.a[slot, :r], stack.b[slot, :, :r]  # (r, in), (out, r)
        delta = (x[rows].to(a.dtype) @ a.t()) @ b.t()  # shrink to (n, r), expand to (n, out)
        if isinstance(rows, slice):
            y[rows] += delta.to(y.dtype)
        else:
            y.index_add_(0, rows, delta.to(y.dtype))
    return y
