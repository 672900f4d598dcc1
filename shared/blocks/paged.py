"""Paged attention's metadata (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention"): a flat batch of tokens from many sequences (decode tokens first, then prefill chunks) and where
each token's K/V lives in a paged cache of (num_blocks, block_size, Hkv, D) per layer (docs/architecture.md).

``MultiHeadAttention.forward_paged`` reads this; the text engine builds it (``services/text/engine/batch.py``).
Nothing here knows about requests.

With a hybrid KV cache (services/text/engine/kv_cache.py) the layers fall into groups with block tables of their
own (sliding-window layers keep only their window's blocks): the batch's own slots and tables are group 0's,
``groups`` holds the others', ``layer_groups`` names each layer's group, and ``layer_views`` gives every layer the
batch it reads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens ``start..start+length-1`` of one sequence, at flat offset ``offset``; ``table``: its blocks (long)."""

    offset: int
    length: int
    start: int
    table: torch.Tensor

    @property
    def context_len(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class GroupTables:
    """Where one more KV group's tokens live: ``slots`` (N,), ``decode_tables`` (Bd, max_blocks) and one table per
    prefill chunk, as PagedBatch's own fields are for group 0."""

    slots: torch.Tensor
    decode_tables: torch.Tensor
    chunk_tables: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class PagedBatch:
    input_ids: torch.Tensor  # (N,) long
    positions: torch.Tensor  # (N,) long
    slots: torch.Tensor  # (N,) long: flat cache slot (block * block_size + offset) of every token
    decode_tables: torch.Tensor  # (Bd, max_blocks) int32: one decode token per sequence, tokens 0..Bd-1
    decode_lens: torch.Tensor  # (Bd,) int32: context length including the decode token
    prefills: tuple[PrefillChunk, ...]
    logits_index: torch.Tensor  # (S,) long: flat tokens whose next-token logits are wanted
    groups: tuple[GroupTables, ...] = ()  # KV groups 1.. of a hybrid cache
    layer_groups: tuple[int, ...] = ()  # layer -> its KV group; () for every layer in group 0
    # (N,) bool: the prompt tokens of sequences whose prompt passes longrope's original context, rotated with its long
    # factors at every position (shared/blocks/rope.py); None where the batch has none
    long_rope: torch.Tensor | None = None

    @property
    def n_decode(self) -> int:
        return int(self.decode_lens.numel())

    def group(self, g: int) -> PagedBatch:
        """The batch as the layers of KV group ``g`` read it: that group's slots and tables."""
        if g == 0:
            return self
        tables = self.groups[g - 1]
        return replace(self, slots=tables.slots, decode_tables=tables.decode_tables, groups=(), layer_groups=(),
                       prefills=tuple(replace(c, table=t) for c, t in zip(self.prefills, tables.chunk_tables,
                                                                             strict=True)))

    def layer_views(self, n_layers: int) -> list[PagedBatch]:
        """The batch each of ``n_layers`` layers reads (one view per group, shared by its layers)."""
        if not self.groups:
            return [self] * n_layers
        views = [self.group(g) for g in range(len(self.groups) + 1)]
        return [views[g] for g in self.layer_groups]

    def to(self, device: torch.device) -> PagedBatch:
        """The same batch with its index tensors on ``device`` (the model's), in ONE host-to-device copy. A step's
        tensors are a few KB each, so a copy apiece pays a transfer's latency six times or more, and a copy from
        pageable memory holds the host until it is done; packed into one int64 buffer, pinned when ``device`` is a
        GPU, they cross in one asynchronous copy and are split into views (cast back to their dtypes) there."""
        if self.input_ids.device == device:
            return self
        n = len(self.prefills)
        parts = [self.input_ids, self.positions, self.slots, self.decode_tables, self.decode_lens, self.logits_index,
                 *(c.table for c in self.prefills)]
        for g in self.groups:
            parts += [g.slots, g.decode_tables, *g.chunk_tables]
        sizes = [p.numel() for p in parts]
        host = torch.empty(sum(sizes), dtype=torch.long, pin_memory=device.type == "cuda")
        torch.cat([p.flatten() for p in parts], out=host)
        moved = [flat.view(p.shape).to(p.dtype)
                 for flat, p in zip(host.to(device, non_blocking=True).split(sizes), parts, strict=True)]
        ids, positions, slots, tables, lens, logits_index = moved[:6]
        chunk_tables, rest = moved[6:6 + n], moved[6 + n:]
        return PagedBatch(
            input_ids=ids, positions=positions, slots=slots, decode_tables=tables, decode_lens=lens,
            prefills=tuple(PrefillChunk(c.offset, c.length, c.start, t)
                           for c, t in zip(self.prefills, chunk_tables, strict=True)),
            logits_index=logits_index, layer_groups=self.layer_groups,
            groups=tuple(GroupTables(rest[i], rest[i + 1], tuple(rest[i + 2:i + 2 + n]))
                         for i in range(0, len(rest), 2 + n)),
            long_rope=self.long_rope.to(device) if self.long_rope is not None else None)


def gather(cache: torch.Tensor, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Positions start..end-1 of one sequence (its blocks: ``table``) out of a paged cache -> (1, Hkv, end-start, D)."""
    block_size = cache.shape[1]
    pos = torch.arange(start, end, device=cache.device)
    slots = table[pos // block_size] * block_size + pos % block_size
    return cache.view(-1, cache.shape[2], cache.shape[3])[slots].transpose(0, 1)[None]
