"""The paged KV cache's bookkeeping: fixed-size blocks and per-sequence block tables (Kwon et al. 2023,
PagedAttention), with automatic prefix caching (vLLM's APC). The K/V tensors themselves belong to the model runner.

Layout (docs/architecture.md, shared with ``kernels/paged_attention.py``): ``k_cache``/``v_cache`` are
``(num_blocks, block_size, n_kv_heads, head_dim)``; token ``t`` of a sequence lives in block
``table[t // block_size]`` at slot ``t % block_size``.

Prefix caching: once every token of a block has its K/V computed, the block is registered under a hash chained over
the tokens of the sequence up to and including it (``h_i = H(h_{i-1}, tokens of block i)``), so equal hashes mean
equal prefixes; a sequence run with a LoRA adapter starts its chain from the adapter's fingerprint instead of
the empty string, since the same tokens give other K/V under another adapter. A new sequence starts from the longest
run of registered blocks matching its leading tokens, shared by reference count, and computes only the rest. A block
nobody references keeps its K/V and its hash on an LRU list; it is evicted (its hash forgotten) only when a fresh
block is needed and the plain free list is empty.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

import torch

from genserve.shared.blocks.kv_cache import kv_cache_bytes


def block_bytes(block_size: int, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                values_apart: bool = True) -> int:
    """Bytes of one block of ``block_size`` tokens over every layer, keys and values
    (Remark 11, "KV Cache Memory Budget", of the chapter "Deep Learning Building Blocks"); ``values_apart`` False for
    a cache whose entries serve as keys and values both (MLA's latent)."""
    both = kv_cache_bytes(n_layers, block_size, n_kv_heads=n_kv_heads, head_dim=head_dim,
                          bytes_per_value=torch.empty((), dtype=dtype).element_size())
    return both if values_apart else both // 2


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The hash of a full block: 128-bit BLAKE2b of the previous block's hash and this block's token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    """Hands out block indices; a sequence's table grows one block at a time. With ``caching``, full blocks are
    shared across sequences through their chained hashes (module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._free: deque[int] = deque(range(num_blocks))  # blocks holding nothing reusable
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: least recently used first
        self._refs = [0] * num_blocks
        self._block_hash: dict[int, bytes] = {}  # cached block -> its hash
        self._cached: dict[bytes, int] = {}  # hash -> cached block
        self._hashes: dict[str, list[bytes]] = {}  # per sequence: hashes of its leading full blocks
        self._registered: dict[str, int] = {}  # per sequence: how many of its leading blocks are cached
        self._roots: dict[str, bytes] = {}  # per sequence: what its chain starts from (its adapter's fingerprint)
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        """The free-blocks gauge: blocks a sequence can take now, cached-but-unreferenced ones included."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered under a hash (referenced or not)."""
        return len(self._cached)

    def blocks_needed(self, seq_id: str, n_tokens: int) -> int:
        """Extra blocks ``seq_id`` needs to hold ``n_tokens`` tokens in total."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, -(-n_tokens // self.block_size) - have)

    def can_grow(self, seq_id: str, n_tokens: int) -> bool:
        return self.blocks_needed(seq_id, n_tokens) <= self.num_free

    def grow(self, seq_id: str, n_tokens: int) -> list[int]:
        """Make ``seq_id``'s table cover ``n_tokens`` tokens; raises MemoryError when too few blocks are free."""
        need = self.blocks_needed(seq_id, n_tokens)
        if need > self.num_free:
            raise MemoryError(f"need {need} KV blocks, {self.num_free} free")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self._take() for _ in range(need))
        return table

    def _take(self) -> int:
        """A fresh block: from the plain free list, else the least recently used cached one, evicted."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._block_hash.pop(block)]
        self._refs[block] = 1
        return block

    def _chain(self, seq_id: str, prompt: list[int], output: list[int], n_blocks: int) -> list[bytes]:
        """The hashes of the first ``n_blocks`` full blocks of ``seq_id``'s tokens ``prompt + output`` (computed once
        per sequence, then extended; the two lists are never concatenated)."""
        hashes = self._hashes.setdefault(seq_id, [])
        bs, n = self.block_size, len(prompt)
        for i in range(len(hashes), n_blocks):
            start, end = i * bs, (i + 1) * bs
            tokens = prompt[start:end] if end <= n else prompt[start:] + output[max(0, start - n):end - n]
            hashes.append(block_hash(hashes[-1] if hashes else self._roots.get(seq_id, b""), tokens))
        return hashes[:n_blocks]

    def match_prefix(self, seq_id: str, prompt: list[int], output: list[int], salt: bytes = b"") -> int:
        """Start ``seq_id``'s (empty) table with the longest run of cached blocks that hold the leading tokens of
        ``prompt + output``; the number of tokens whose K/V it thereby has. At least one token is always left to
        compute: its logits are what the next step samples from. ``salt`` starts the sequence's hash chain (its
        LoRA adapter's fingerprint): only blocks computed with the same salt match."""
        if self.tables.get(seq_id):
            raise ValueError(f"{seq_id!r} already holds blocks")
        if salt:
            self._roots[seq_id] = salt
        table: list[int] = []
        if self.caching:
            for h in self._chain(seq_id, prompt, output, (len(prompt) + len(output) - 1) // self.block_size):
                block = self._cached.get(h)
                if block is None:
                    break
                if self._refs[block] == 0:
                    del self._evictable[block]
                self._refs[block] += 1
                table.append(block)
        self.tables[seq_id] = table
        self._registered[seq_id] = len(table)
        return len(table) * self.block_size

    def register(self, seq_id: str, prompt: list[int], output: list[int], num_computed: int) -> None:
        """Cache every block of ``seq_id`` that the first ``num_computed`` of its tokens ``prompt + output`` fill
        (their K/V are written).
        A block whose hash another block already holds stays private (it is freed like an uncached one)."""
        n_full = num_computed // self.block_size
        done = self._registered.get(seq_id, 0)
        if not self.caching or n_full <= done:
            return
        table = self.tables[seq_id]
        for i, h in enumerate(self._chain(seq_id, prompt, output, n_full)[done:], start=done):
            if h not in self._cached:
                self._cached[h] = table[i]
                self._block_hash[table[i]] = h
        self._registered[seq_id] = n_full

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        """Flat slot indices (``block * block_size + offset``) of token positions ``start..end-1`` of a table."""
        bs = self.block_size
        return [table[t // bs] * bs + t % bs for t in range(start, end)]

    def truncate(self, seq_id: str, n_tokens: int) -> int:
        """Shrink ``seq_id``'s table to the blocks that ``n_tokens`` tokens fill (the rollback of rejected
        speculative slots); the number released. Only blocks past every registered (cached) one may go."""
        table = self.tables[seq_id]
        keep = -(-n_tokens // self.block_size)
        if keep < self._registered.get(seq_id, 0):
            raise ValueError(f"cannot truncate {seq_id!r} below its cached blocks")
        released = table[keep:]
        del table[keep:]
        self._release(released)
        return len(released)

    def _release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._block_hash:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def free(self, seq_id: str) -> int:
        """Release every block of ``seq_id``; the number released. A block nobody else references goes to the free
        list, or, when cached, to the most recently used end of the eviction list; the table is released back to
        front, so a sequence's later blocks are evicted before its earlier ones, which more requests share."""
        table = self.tables.pop(seq_id, [])
        self._hashes.pop(seq_id, None)
        self._registered.pop(seq_id, None)
        self._roots.pop(seq_id, None)
        self._release(table)
        return len(table)
