"""Continuous batching (Yu et al. 2022, Orca) over the paged KV cache, with chunked prefill and preemption by
recompute (Kwon et al. 2023, vLLM).

Every step: (1) each running sequence that has all but its newest token cached gets one decode slot, preempting
the latest arrivals when the free list runs short; (2) the remaining token budget goes to prefill chunks, first of
running sequences mid-prefill, then of waiting requests in arrival order. A preempted sequence frees all its
blocks and goes back to the front of the queue; its prompt and generated tokens are recomputed when it returns.

With prefix caching (kv_cache.py), a sequence admitted from the queue (first or after a preemption) starts from the
cached blocks that hold its leading tokens and only schedules the rest; ``hit_tokens`` / ``queried_tokens`` count
them. Blocks are registered in the cache by the engine once the step that fills them has run, which is also when
a sliding-window group releases the blocks that left its window (kv_cache.py, hybrid allocation).

With LoRA adapters, the running sequences use at most ``max_loras`` distinct adapters (the runner's slots): a
waiting request whose adapter would be one too many stays queued while later ones that fit are admitted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from genserve.services.text.engine.kv_cache import BlockManager
from genserve.services.text.engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens ``start..start+length-1`` of ``seq``; ``sample`` when the chunk reaches its last token.
    ``draft``: speculative tokens (engine/speculative.py) that follow the chunk's last token; they are computed
    too, at positions ``start+length..``, and every position from the last token on gets its logits."""

    seq: Sequence
    start: int
    length: int
    draft: tuple[int, ...] = ()
    forced: bool = False  # the draft is the text the request's grammar forces (jump-forward), not a guess

    @property
    def sample(self) -> bool:
        return self.start + self.length == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's share of EngineConfig, whose defaults are the only ones."""

    max_batched_tokens: int  # tokens computed per step (decode slots + prefill chunks)
    max_running: int
    max_waiting: int
    max_loras: int = 0  # distinct LoRA adapters among the running sequences; 0: no adapters

    def __post_init__(self) -> None:
        for name in ("max_batched_tokens", "max_running", "max_waiting"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig):
        self.blocks = blocks
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.overflowed: list[Sequence] = []
        self.hit_tokens = 0  # prompt tokens admitted with their K/V already cached
        self.queried_tokens = 0  # tokens of every admitted sequence

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop ``seq`` from the queues and return its blocks to the free list."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.request_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.num_computed = seq.draft_computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _reserve_decode(self, seq: Sequence, scheduled: set[int]) -> bool:
        """One more slot for ``seq``, preempting the newest unscheduled running sequences; when none is left,
        ``seq`` itself is preempted (or, alone in the cache, finished with ``context_length``)."""
        while not self.blocks.can_grow(seq.request_id, seq.num_tokens):
            victims = [s for s in self.running if s is not seq and id(s) not in scheduled]
            if victims:
                self._preempt(max(victims, key=lambda s: s.arrival))
            elif len(self.running) == 1:
                self.running.remove(seq)
                self.blocks.free(seq.request_id)
                self.overflowed.append(seq)
                return False
            else:
                self._preempt(seq)
                return False
        self.blocks.grow(seq.request_id, seq.num_tokens)
        return True

    def reserve_ahead(self, seqs: list[Sequence], extra: int) -> bool:
        """Slots for ``extra`` more tokens past each sequence's newest (lookahead decode steps), taken only when the
        free list holds all of them: nobody is preempted for a lookahead. False, and nothing reserved, otherwise."""
        needed = sum(self.blocks.blocks_needed(s.request_id, s.num_tokens + extra) for s in seqs)
        if needed > self.blocks.num_free:
            return False
        for s in seqs:
            self.blocks.grow(s.request_id, s.num_tokens + extra)
        return True

    def schedule(self) -> list[ScheduledChunk]:
        """The chunks to compute this step; sequences that can never fit land in ``self.overflowed``."""
        self.overflowed = []
        budget = self.config.max_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        for seq in sorted((s for s in self.running if not s.in_prefill), key=lambda s: s.arrival):
            if seq not in self.running or budget == 0:
                continue  # preempted earlier in this loop
            if self._reserve_decode(seq, scheduled):
                chunks.append(ScheduledChunk(seq, seq.num_computed, 1))
                scheduled.add(id(seq))
                budget -= 1
        for seq in [s for s in self.running if s.in_prefill]:
            budget -= self._prefill_chunk(seq, budget, chunks)
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_running:
                break
            if not self._adapter_fits(seq):
                continue
            used = self._prefill_chunk(seq, budget, chunks)
            if used == 0:
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            self.hit_tokens += seq.num_computed
            self.queried_tokens += seq.num_tokens
            budget -= used
        if not chunks and self.running:
            # Every running sequence is stuck mid-prefill with the cache full: free the newest and retry.
            newest = max(self.running, key=lambda s: s.arrival)
            if len(self.running) == 1:
                self.remove(newest)
                self.overflowed.append(newest)
                return []
            self._preempt(newest)
            overflowed = self.overflowed
            chunks = self.schedule()
            self.overflowed = overflowed + self.overflowed
        return chunks

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether running ``seq`` keeps the running sequences within ``max_loras`` distinct adapters."""
        if seq.adapter is None:
            return True
        running = {id(s.adapter) for s in self.running if s.adapter is not None}
        return id(seq.adapter) in running or len(running) < self.config.max_loras

    def _prefill_chunk(self, seq: Sequence, budget: int, chunks: list[ScheduledChunk]) -> int:
        """Schedule as much of ``seq``'s uncomputed tokens as the budget and free blocks allow; tokens used. A
        sequence without blocks first takes the cached blocks of its prefix, and gives them back when nothing of
        it can be scheduled (a waiting sequence holds no blocks)."""
        admitting = seq.request_id not in self.blocks.tables
        if admitting:
            seq.num_computed = self.blocks.match_prefix(seq.request_id, seq.prompt_ids, seq.output_ids,
                                                        seq.cache_salt)
        room = self.blocks.tokens_fit(seq.request_id) - seq.num_computed
        length = min(seq.num_tokens - seq.num_computed, budget, room)
        if length <= 0:
            if admitting:
                self.blocks.free(seq.request_id)
                seq.num_computed = 0
            return 0
        self.blocks.grow(seq.request_id, seq.num_computed + length)
        chunks.append(ScheduledChunk(seq, seq.num_computed, length))
        return length
