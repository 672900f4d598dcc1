"""Scheduled chunks -> the model's ``PagedBatch`` (flat token ids, positions, cache slots, block tables)."""

from __future__ import annotations

import torch

from genserve.services.text.engine.kv_cache import BlockManager
from genserve.services.text.engine.scheduler import ScheduledChunk
from genserve.shared.blocks.paged import PagedBatch, PrefillChunk


def build_batch(chunks: list[ScheduledChunk], blocks: BlockManager) -> tuple[PagedBatch, list[ScheduledChunk]]:
    """The batch for ``chunks`` and the chunks reordered to match it (decode tokens first, then prefills). A chunk
    with a speculative draft is a prefill chunk of its tokens and the draft (the verify pass), with the logits of
    its last token and of every draft token kept."""
    decodes = [c for c in chunks if c.length == 1 and not c.draft]
    prefills = [c for c in chunks if c.length > 1 or c.draft]
    ordered = decodes + prefills
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_index: list[int] = []
    tables = [blocks.tables[c.seq.request_id] for c in ordered]
    for c, table in zip(ordered, tables, strict=True):
        tokens = c.seq.tokens
        n = c.length + len(c.draft)
        if c.sample:
            logits_index.extend(range(len(ids) + c.length - 1, len(ids) + n))
        ids.extend(tokens[c.start:c.start + c.length])
        ids.extend(c.draft)
        positions.extend(range(c.start, c.start + n))
        slots.extend(blocks.slots(table, c.start, c.start + n))
    width = max((len(t) for t in tables[:len(decodes)]), default=1)
    # One tensor per field, built from Python lists in one call each: a decode step is short enough on the CPU
    # that every extra small tensor op shows in tokens/s.
    decode_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables[:len(decodes)]],
                                 dtype=torch.int32).view(len(decodes), width)
    chunks_out = []
    offset = len(decodes)
    for c, table in zip(prefills, tables[len(decodes):], strict=True):
        n = c.length + len(c.draft)
        chunks_out.append(PrefillChunk(offset, n, c.start, torch.tensor(table, dtype=torch.long)))
        offset += n
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
