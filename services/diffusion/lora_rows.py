"""Per-row-group LoRA deltas for one forward pass that mixes requests with different LoRAs, or none: the base product
runs once for the whole batch, then every adapted layer adds y[rows] += scale · (x[rows] Aᵀ) Bᵀ for each group of
batch rows, unfused (Punica's SGMV in plain torch: Chen et al. 2023, "Punica"). The denoising loop shares its U-Net
call this way (services/diffusion/step_batcher.py); docs/architecture.md says why not merged weights or turns.

Forward hooks on the adaptable layers read the groups of the call in flight from a thread-local stack (`rows`): the
step loop's thread runs a U-Net call with its requests' groups while a worker thread encodes another request's
prompt under that request's LoRA alone.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from genserve.shared.blocks.cross_attention import ContextCache, CrossAttention


@dataclass(frozen=True, eq=False)
class RowGroup:
    """Batch rows [start, stop) take ``scale`` times these deltas: module name -> (A (r, in), B (out, r) with the
    layer's alpha / r folded in)."""

    start: int
    stop: int
    deltas: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float


class RowLoras:
    """Hooks on ``model``'s layers ``names`` (installed once, before serving: a hook added while another thread runs
    the model could change the hook table under it) that add the current groups' deltas to their outputs."""

    def __init__(self, model: nn.Module, names: Iterable[str]) -> None:
        self._local = threading.local()
        modules = dict(model.named_modules())
        for name in names:
            modules[name].register_forward_hook(functools.partial(self._add, name))

    @contextmanager
    def rows(self, groups: Sequence[RowGroup]) -> Iterator[None]:
        """Within this block, this thread's calls of the model adapt ``groups`` (none: the base model)."""
        outer = getattr(self._local, "groups", ())
        self._local.groups = tuple(g for g in groups if g.scale and g.deltas)
        try:
            yield
        finally:
            self._local.groups = outer

    def _add(self, name: str, module: nn.Module, inputs: tuple[torch.Tensor, ...], y: torch.Tensor) -> None:
        for group in getattr(self._local, "groups", ()):
            delta = group.deltas.get(name)
            if delta is None:
                continue
            a, b = delta
            x = inputs[0][group.start : group.stop]  # (n, ..., in)
            y[group.start : group.stop] += group.scale * ((x @ a.t()) @ b.t())  # shrink to (n, ..., r), expand


class AdaptedContext(ContextCache):
    """A request's text context whose cross-attention keys and values are projected under the request's own groups
    (its LoRA over all its rows, or none), not under those of the U-Net call that first reads them: that call stacks
    other requests' rows, while ``to_k``/``to_v`` see this request's text alone."""

    def __init__(self, context: torch.Tensor, loras: RowLoras, groups: Sequence[RowGroup]) -> None:
        super().__init__(context)
        self.loras, self.groups = loras, groups

    def keys_values(self, attn: CrossAttention) -> tuple[torch.Tensor, torch.Tensor]:
        with self.loras.rows(self.groups):
            return super().keys_values(attn)
