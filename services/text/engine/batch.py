"""Scheduled chunks -> the model's ``PagedBatch`` (flat token ids, positions, cache slots, block tables)."""

from __future__ import annotations

import torch

from genserve.services.text.engine.kv_cache import BlockManager
from genserve.services.text.engine.scheduler import ScheduledChunk
from genserve.shared.blocks.paged import GroupTables, PagedBatch, PrefillChunk


def build_batch(chunks: list[ScheduledChunk], blocks: BlockManager, *, first_group_only: bool = False
                ) -> tuple[PagedBatch, list[ScheduledChunk]]:
    """The batch for ``chunks`` and the chunks reordered to match it (decode tokens first, then prefills).
    ``first_group_only``: every layer reads KV group 0's slots and tables (the draft model's batch, engine/draft.py,
    whose one cache is indexed by the target's group-0 blocks).

    A chunk with a speculative draft of k tokens (the verify pass, engine/speculative.py) becomes k + 1 decode rows
    of its sequence, its newest token and each draft at the following positions, sharing its block table, row j
    with context length ``start + 1 + j``, every row's logits kept. Both attention paths write every row's K/V into
    the cache before any row attends (``MultiHeadAttention.forward_paged``; the fused C step's key store precedes
    its attention loop), so row j sees rows 0..j: causal attention over the chunk, and the runner's decode paths
    (the fused CPU step, CUDA graphs) score all k + 1 positions."""
    decodes = [c for c in chunks if c.length == 1]
    prefills = [c for c in chunks if c.length > 1]
    ordered = decodes + prefills
    ids: list[int] = []
    positions: list[int] = []
    logits_index: list[int] = []
    decode_lens: list[int] = []
    long_rope: list[int] = []  # flat indices of the prompt tokens rotated with longrope's long factors
    for c in ordered:
        n = c.length + len(c.draft)
        if c.sample:
            logits_index.extend(range(len(ids) + c.length - 1, len(ids) + n))
        if c.length == 1:
            decode_lens.extend(range(c.start + 1, c.start + 1 + n))
        if c.seq.long_rope and c.start < len(c.seq.prompt_ids):
            long_rope.extend(range(len(ids), len(ids) + min(c.length, len(c.seq.prompt_ids) - c.start)))
        ids.extend(c.seq.tokens[c.start:c.start + c.length])
        ids.extend(c.draft)
        positions.extend(range(c.start, c.start + n))
    # Every KV group's slots and tables (one group without a hybrid cache: kv_cache.py), all the same width.
    groups = [_group_tables(ordered, blocks, [blocks.group_tables[c.seq.request_id][g] for c in ordered])
              for g in range(1 if first_group_only else len(blocks.windows))]
    slots, decode_tables, chunk_tables = groups[0]
    chunks_out = []
    offset = len(decode_lens)
    for c, table in zip(prefills, chunk_tables, strict=True):
        chunks_out.append(PrefillChunk(offset, c.length, c.start, table))
        offset += c.length
    flat = torch.tensor([ids, positions, slots], dtype=torch.long)  # (3, N): three contiguous rows
    batch = PagedBatch(
        input_ids=flat[0],
        positions=flat[1],
        slots=flat[2],
        decode_tables=decode_tables,
        decode_lens=torch.tensor(decode_lens, dtype=torch.int32),
        prefills=tuple(chunks_out),
        logits_index=torch.tensor(logits_index, dtype=torch.long),
        groups=tuple(GroupTables(torch.tensor(s, dtype=torch.long), t, c) for s, t, c in groups[1:]),
        layer_groups=() if first_group_only else blocks.layer_groups,
        long_rope=_mask(len(ids), long_rope) if long_rope else None,
    )
    return batch, ordered


def _mask(n: int, indices: list[int]) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[indices] = True
    return mask


def _group_tables(ordered: list[ScheduledChunk], blocks: BlockManager, tables: list[list[int]]
                  ) -> tuple[list[int], torch.Tensor, tuple[torch.Tensor, ...]]:
    """One KV group's slots (N,), decode tables (Bd, width) int32 and prefill chunk tables, ``tables[i]`` being
    that group's table of ``ordered[i]``'s sequence."""
    slots: list[int] = []
    decode_rows: list[list[int]] = []  # the block table of every decode row
    chunk_tables: list[torch.Tensor] = []
    for c, table in zip(ordered, tables, strict=True):
        n = c.length + len(c.draft)
        if c.length == 1:
            decode_rows.extend([table] * n)
        else:
            chunk_tables.append(torch.tensor(table, dtype=torch.long))
        slots.extend(blocks.slots(table, c.start, c.start + n))
    width = max((len(t) for t in decode_rows), default=1)
    # One tensor per field, built from Python lists in one call each: a decode step is short enough on the CPU
    # that every extra small tensor op shows in tokens/s.
    decode_tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_rows],
                                 dtype=torch.int32).view(len(decode_rows), width)
    return slots, decode_tables, tuple(chunk_tables)
