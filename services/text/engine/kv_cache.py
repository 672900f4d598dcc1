"""The paged KV cache: fixed-size blocks in one tensor per layer, a free list, and per-sequence block tables.

Layout (docs/architecture.md, shared with ``kernels/paged_attention.py``): ``k_cache``/``v_cache`` are
``(num_blocks, block_size, n_kv_heads, head_dim)``; token ``t`` of a sequence lives in block
``table[t // block_size]`` at slot ``t % block_size`` (Kwon et al. 2023, PagedAttention).
"""

from __future__ import annotations

from collections import deque

import torch

from shared.blocks.kv_cache import kv_cache_bytes


def blocks_for_budget(budget_bytes: int, block_size: int, n_layers: int, n_kv_heads: int, head_dim: int,
                      dtype: torch.dtype) -> int:
    """How many blocks of ``block_size`` tokens fit in ``budget_bytes`` (the KV-cache size formula, Remark 11)."""
    per_block = kv_cache_bytes(n_layers, block_size, n_kv_heads=n_kv_heads, head_dim=head_dim,
                               bytes_per_value=torch.empty((), dtype=dtype).element_size())
    return budget_bytes // per_block


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

    def free(self, seq_id: str) -> int:
        """Return every block of ``seq_id`` to the free list; the number returned."""
        table = self.tables.pop(seq_id, [])
        self._free.extend(table)
        return len(table)


class PagedKVCache:
    """Per-layer K and V tensors in the paged layout, plus the block manager that owns their blocks."""

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.manager = BlockManager(num_blocks, block_size)
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]

    @property
    def block_size(self) -> int:
        return self.manager.block_size

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        """Flat slot indices (``block * block_size + offset``) of token positions ``start..end-1``."""
        bs = self.block_size
        return [table[t // bs] * bs + t % bs for t in range(start, end)]
