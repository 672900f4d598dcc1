"""Draft-model speculation (Leviathan et al. 2023; Chen et al. 2023): a smaller model with the target's tokenizer
drafts k tokens per sequence, greedily, and the target verifies them in one pass (engine/speculative.py).

The draft model has its own runner and its own paged KV cache, indexed by the target's block tables (KV group 0):
a draft block is the target block of the same id, so the draft needs no allocator of its own, its K/V is freed,
preempted and rolled back with the target's, and a token's draft K/V lives at the slot of its target K/V. Each
sequence keeps ``draft_computed``, the tokens whose draft K/V is written. A draft pass runs the tokens from there
to the sequence's newest as one chunk (one token in the steady state; two after a pass that accepted every draft;
the whole prompt the first time, or after steps without drafts), then k single-token steps, on the runner's
multi-step greedy path where it has one (the CPU's fused step: one call for the whole pass).

The drafts are the draft model's argmax, a deterministic function of the context: a point-mass proposal q = δ_d,
for which speculative.py's acceptance rule keeps the target's distribution exactly. The output never depends on
the draft model, only the acceptance rate does, so a draft K/V that another sequence's prefix-cache hit would
share is recomputed rather than trusted (``draft_computed`` starts at 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from genserve.services.text.engine.batch import build_batch
from genserve.services.text.engine.kv_cache import BlockManager
from genserve.services.text.engine.runner import ModelRunner
from genserve.services.text.engine.scheduler import ScheduledChunk
from genserve.services.text.engine.sequence import Sequence


@dataclass(frozen=True, eq=False)
class _Drafting:
    """A sequence with its drafts so far appended: what a draft step's ``ScheduledChunk`` reads (request_id, tokens,
    num_tokens)."""

    request_id: str
    tokens: list[int]
    # its steps lie past the prompt, where each position's own RoPE table row applies (engine/batch.py)
    long_rope = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class DraftProposer:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, vocab_size: int):
        """``runner``: the draft model's, its KV cache still to allocate; ``blocks``: the target's block manager;
        ``vocab_size``: the target's (a draft token past it is never proposed)."""
        self.runner = runner
        self.blocks = blocks
        self.vocab_size = vocab_size
        runner.allocate_kv_cache(blocks.num_blocks, blocks.block_size)

    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        """Up to ``k`` greedy draft tokens for each of ``seqs``, whose block tables cover ``num_tokens + k`` tokens.

        The draft model runs k + 1 steps, the last only to write the K/V of the k-th draft: when the target accepts
        every draft, the next pass then starts from one new token (the bonus), a decode row that the runner's
        multi-step greedy path takes, not a two-token chunk that would need a step of its own."""
        steps = k + 1
        chunks = [ScheduledChunk(s, s.draft_computed, s.num_tokens - s.draft_computed) for s in seqs]
        batch, ordered = build_batch(chunks, self.blocks, first_group_only=True)
        drafts: dict[int, list[int]] = {id(c.seq): [] for c in ordered}
        if not batch.prefills and self.runner.max_steps(len(ordered)) >= steps:
            for c, row in zip(ordered, self.runner.execute_greedy(batch, steps), strict=True):
                drafts[id(c.seq)] = row[:k]
        else:
            for step in range(steps):
                logits = self.runner.execute_logits(batch)  # (S, V): each sequence's newest position
                if step == k:
                    break
                for c, token in zip(ordered, logits[:, :self.vocab_size].argmax(-1).tolist(), strict=True):
                    drafts[id(c.seq)].append(token)
                # the next step: one decode row per sequence, in the same order
                views = [_Drafting(c.seq.request_id, c.seq.tokens + drafts[id(c.seq)]) for c in ordered]
                batch, _ = build_batch([ScheduledChunk(v, v.num_tokens - 1, 1) for v in views], self.blocks,
                                       first_group_only=True)
        for s in seqs:
            s.draft_computed = s.num_tokens + k
        return [_within(drafts[id(s)], self.vocab_size) for s in seqs]


def _within(draft: list[int], vocab_size: int) -> list[int]:
    """``draft`` up to its first token outside the target's vocabulary (a draft model may pad its own further)."""
    return next((draft[:j] for j, t in enumerate(draft) if t >= vocab_size), draft)
