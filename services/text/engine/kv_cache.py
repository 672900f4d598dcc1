"""The paged KV cache's bookkeeping: a free list of fixed-size blocks and per-sequence block tables (Kwon et al.
2023, PagedAttention). The K/V tensors themselves belong to the model runner.

Layout (docs/architecture.md, shared with ``kernels/paged_attention.py``): ``k_cache``/``v_cache`` are
``(num_blocks, block_size, n_kv_heads, head_dim)``; token ``t`` of a sequence lives in block
``table[t // block_size]`` at slot ``t % block_size``.
"""

from __future__ import annotations

from collections import deque

import torch

from shared.blocks.kv_cache import kv_cache_bytes


def block_bytes(block_size: int, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block of ``block_size`` tokens over every layer, keys and values (Remark 11)."""
    return kv_cache_bytes(n_layers, block_size, n_kv_heads=n_kv_heads, head_dim=head_dim,
                          bytes_per_value=torch.empty((), dtype=dtype).element_size())


class BlockManager:
    """Hands out block indices from a free list; a sequence's table grows one block at a time."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        """The free-blocks gauge."""
        return len(self._free)

    def blocks_needed(self, seq_id: str, n_tokens: int) -> int:
        """Extra blocks ``seq_id`` needs to hold ``n_tokens`` tokens in total."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, -(-n_tokens // self.block_size) - have)

    def can_grow(self, seq_id: str, n_tokens: int) -> bool:
        return self.blocks_needed(seq_id, n_tokens) <= len(self._free)

    def grow(self, seq_id: str, n_tokens: int) -> list[int]:
        """Make ``seq_id``'s table cover ``n_tokens`` tokens; raises MemoryError when the free list is short."""
        need = self.blocks_needed(seq_id, n_tokens)
        if need > len(self._free):
            raise MemoryError(f"need {need} KV blocks, {len(self._free)} free")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self._free.popleft() for _ in range(need))
        return table

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        """Flat slot indices (``block * block_size + offset``) of token positions ``start..end-1`` of a table."""
        bs = self.block_size
        return [table[t // bs] * bs + t % bs for t in range(start, end)]

    def free(self, seq_id: str) -> int:
        """Return every block of ``seq_id`` to the free list; the number returned."""
        table = self.tables.pop(seq_id, [])
        self._free.extend(table)
        return len(table)
