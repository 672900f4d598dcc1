"""Scheduled chunks -> the model's ``PagedBatch`` (flat token ids, positions, cache slots, block tables)."""

from __future__ import annotations

import torch

from genserve.services.text.engine.kv_cache import BlockManager
from genserve.services.text.engine.scheduler import ScheduledChunk
from genserve.shared.blocks.paged import PagedBatch, PrefillChunk


def build_batch(chunks: list[ScheduledChunk], blocks: BlockManager) -> tuple[PagedBatch, list[ScheduledChunk]]:
    """The batch for ``chunks`` and the chunks reordered to match it (decode tokens first, then prefills)."""
    decodes = [c for c in chunks if c.length == 1]
    prefills = [c for c in chunks if c.length > 1]
    ordered = decodes + prefills
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_index: list[int] = []
    tables = [blocks.tables[c.seq.request_id] for c in ordered]
    for c, table in zip(ordered, tables, strict=True):
        tokens = c.seq.tokens
        if c.sample:
            logits_index.append(len(ids) + c.length - 1)
        ids.extend(tokens[c.start:c.start + c.length])
        positions.extend(range(c.start, c.start + c.length))
        slots.extend(blocks.slots(table, c.start, c.start + c.length))
    width = max((len(t) for t in tables[:len(decodes)]), default=1)
    # One tensor per field, built from Python lists in one call each: a decode step is short enough on the CPU
    # that every extra small tensor op shows in tokens/s.
    decode_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables[:len(decodes)]],
                                 dtype=torch.int32).view(len(decodes), width)
    chunks_out = []
    offset = len(decodes)
    for c, table in zip(prefills, tables[len(decodes):], strict=True):
        chunks_out.append(PrefillChunk(offset, c.length, c.start, torch.tensor(table, dtype=torch.long)))
        offset += c.length
    flat = torch.tensor([ids, positions, slots], dtype=torch.long)  # (3, N): three contiguous rows
    batch = PagedBatch(
        input_ids=flat[0],
        positions=flat[1],
        slots=flat[2],
        decode_tables=decode_tables,
        decode_lens=torch.tensor([c.start + 1 for c in decodes], dtype=torch.int32),
        prefills=tuple(chunks_out),
        logits_index=torch.tensor(logits_index, dtype=torch.long),
    )
    return batch, ordered
