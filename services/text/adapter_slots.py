"""The model runner's side of multi-LoRA: a ``LoraStack`` (shared/blocks/lora.py) for every adaptable projection of a
decoder, ``max_loras`` slots each, and the per-step mapping of tokens to slots.

The torch and Triton paths add the delta where the projection is computed, through a forward hook on each adapted
module: it adds ``backend.lora(...)`` to the projection's output for the step's mapping and returns the output
untouched when the step has no adapter row. A hook, rather than wrapping the modules as PEFT does, keeps the module
tree (and so the checkpoint names and the fused CPU step's view of the weights) as it is; the hooks exist only on an
engine configured for adapters. The fused CPU step reads the stacks itself (runners/cpu.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from genserve.services.text.lora import TARGETS, LoraAdapter, Module
from genserve.services.text.model import LlamaForCausalLM
from genserve.shared.blocks.attention import MultiHeadAttention
from genserve.shared.blocks.ffn import SwiGLU
from genserve.shared.blocks.lora import LoraMapping, LoraStack


def adaptable_projections(model: LlamaForCausalLM) -> dict[Module, nn.Module]:
    """(layer, projection name) -> module for every projection an adapter may target: the q/k/v/o projections of
    standard attention and SwiGLU's gate/up/down (not MLA's, nor a mixture of experts')."""
    out: dict[Module, nn.Module] = {}
    for i, layer in enumerate(model.model.layers):
        for sublayer, kind in ((layer.self_attn, MultiHeadAttention), (layer.mlp, SwiGLU)):
            if isinstance(sublayer, kind):
                for name, where in TARGETS.items():
                    if (where == "self_attn") == (kind is MultiHeadAttention):
                        out[(i, name)] = getattr(sublayer, name)
    return out


class AdapterSlots:
    """``slots`` adapter slots of rank up to ``max_rank`` on every adaptable projection of ``model``, in ``dtype`` on
    the model's device."""

    def __init__(self, model: LlamaForCausalLM, slots: int, max_rank: int, dtype: torch.dtype):
        device = model.model.embed_tokens.weight.device
        self.backend = model.backend
        self.num_slots, self.max_rank = slots, max_rank
        self.stacks: dict[Module, LoraStack] = {}
        self.mapping: LoraMapping | None = None
        for key, module in adaptable_projections(model).items():
            stack = LoraStack(slots, max_rank, module.in_features, module.out_features, dtype=dtype, device=device)
            self.stacks[key] = stack
            module.register_forward_hook(self._hook(stack))
        self.held: list[LoraAdapter | None] = [None] * slots

    def _hook(self, stack: LoraStack):
        def add_delta(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            mapping = self.mapping
            return out if mapping is None else self.backend.lora(out, args[0], stack, mapping)

        return add_delta

    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Put ``adapter``'s weights into ``slot`` of every stack (zeros where it adapts nothing); None clears it."""
        for key, stack in self.stacks.items():
            a, b = adapter.weights.get(key, (None, None)) if adapter is not None else (None, None)
            stack.write(slot, a, b)
        self.held[slot] = adapter

    @contextmanager
    def applied(self, lora: torch.Tensor | None) -> Iterator[None]:
        """Within the block, projections add the deltas of ``lora``: the slot of each token of the step (N,) int32,
        -1 for the base model; None adds nothing."""
        if lora is None:
            yield
            return
        self.mapping = LoraMapping(lora.to(next(iter(self.stacks.values())).a.device))
        try:
            yield
        finally:
            self.mapping = None
