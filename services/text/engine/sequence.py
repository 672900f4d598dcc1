"""One request inside the engine: its tokens, how many of them already have K/V in the cache, and its
streaming state (detokenizer, stop checker, generator)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from genserve.services.text.engine.detokenizer import IncrementalDetokenizer, StopChecker
from genserve.services.text.engine.grammar import Grammar
from genserve.services.text.engine.params import Delta, SamplingParams
from genserve.services.text.lora import LoraAdapter


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    stopper: StopChecker
    on_delta: Callable[[Delta], None]
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    arrival: int = 0  # admission order: later arrivals are preempted first
    interactive: bool = False  # its consumer shows tokens as they come: every token leaves the engine at once
    grammar: Grammar | None = None  # structured output: the tokens the grammar allows next
    # Speculation's back-off (engine/speculative.py): verify passes in a row that accepted no draft, and the steps
    # left to run without a draft.
    spec_misses: int = 0
    spec_skip: int = 0
    spec_k: int = 0  # the draft length it may get next (adaptive k, engine/speculative.py); 0: num_tokens
    # Tokens whose K/V the draft model holds (engine/draft.py); never more than num_computed after a verify pass, and
    # 0 again when preemption frees the blocks.
    draft_computed: int = 0
    adapter: LoraAdapter | None = None  # the LoRA adapter it runs with, held until it finishes
    lora_slot: int = -1  # the runner's slot holding that adapter this step (engine._place_adapters)
    # its prompt passes longrope's original context: the prompt is rotated with the long factors (shared/blocks/rope.py)
    long_rope: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def cache_salt(self) -> bytes:
        """What its prefix-cache chain starts from: the adapter's fingerprint, or nothing for the base model; a long
        prompt's K/V are rotated otherwise (`long_rope`), so they match only their kind."""
        salt = self.adapter.fingerprint if self.adapter is not None else b""
        return salt + b"longrope:long" if self.long_rope else salt

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        return self.num_tokens - self.num_computed > 1
