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

Hybrid allocation (vLLM's hybrid KV-cache manager, RFC vllm#11382; llama.cpp#12637): a sliding-window layer never
reads a key older than its window, so its K/V need only the blocks of a sequence's last ``window`` tokens. The
layers are split into groups of equal size (``kv_groups``), one per kind and as many per kind as it takes, and every
group has its own block table per sequence; all groups take their blocks from ONE pool, each block holding a group's
layers (the runner gives group-mates' layers the same cache tensors), so the budget moves freely between kinds. A
sliding group's table drops (releases) its blocks as they leave the window of every token still to compute, and
holds ``null_block`` in their place: a readable index the kernels mask, as they read only a window's keys. A
Gemma-3-shaped model (5 sliding layers in 6) thereby holds close to 6x the context of one table for every layer.

Prefix caching with sliding groups: every group registers its own full blocks under the same chained hashes. A hit
of n tokens needs the leading blocks of every full group, but of a sliding group only the blocks that the token at
n can still attend to (its window); a sliding block released earlier may already be evicted, so the hit is the
longest n for which all of these are cached, and the new sequence's sliding tables start with null blocks below the
window. A cached sliding block thus never serves tokens it cannot see, and no evicted one is ever read.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class KVGroup:
    """Layers whose K/V share one block table: full attention (``window`` 0) or one sliding window."""

    window: int
    layers: tuple[int, ...]


def kv_groups(windows: Sequence[int]) -> tuple[KVGroup, ...]:
    """The hybrid allocation's groups for layers whose windows are ``windows`` (0: full attention): each kind's layers
    in groups of the gcd of the kinds' layer counts, so that every group has as many layers and one block holds the
    same bytes in any of them; full-attention groups first. One kind gives one group of every layer."""
    by_window: dict[int, list[int]] = {}
    for i, window in enumerate(windows):
        by_window.setdefault(window, []).append(i)
    size = math.gcd(*map(len, by_window.values()))
    return tuple(KVGroup(window, tuple(layers[j:j + size]))
                 for window, layers in sorted(by_window.items()) for j in range(0, len(layers), size))


def layer_groups(groups: tuple[KVGroup, ...]) -> tuple[int, ...]:
    """Each layer's group (PagedBatch.layer_groups); () when one group holds every layer."""
    group_of = {i: g for g, group in enumerate(groups) for i in group.layers}
    return tuple(group_of[i] for i in range(len(group_of))) if len(groups) > 1 else ()


def layer_tensors(n_layers: int, groups: tuple[KVGroup, ...]) -> list[int]:
    """Which of a runner's cache tensors each layer writes: its place in its group, so that the j-th layers of all
    groups share tensor j (a block belongs to one group at a time); without groups, a tensor per layer."""
    if not groups:
        return list(range(n_layers))
    place = {layer: j for group in groups for j, layer in enumerate(group.layers)}
    return [place[i] for i in range(n_layers)]


def window_span(window: int, block_size: int) -> int:
    """The most blocks ``window`` consecutive positions touch (the tokens a sliding group must hold at once)."""
    return -(-(window - 1) // block_size) + 1


def blocks_held(windows: Sequence[int], block_size: int, n_tokens: int) -> int:
    """The most blocks one sequence of ``n_tokens`` tokens holds over groups of these ``windows`` (0: full) when its
    sliding groups keep only their windows: the size of one full context, and what bounds a lone sequence."""
    n_blocks = -(-n_tokens // block_size)
    return sum(min(n_blocks, window_span(w, block_size)) if w else n_blocks for w in windows)


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The hash of a full block: 128-bit BLAKE2b of the previous block's hash and this block's token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    """Hands out block indices; a sequence's tables grow one block at a time, every group's together. With
    ``caching``, full blocks are shared across sequences through their chained hashes (module docstring).
    ``groups``: the hybrid allocation's layer groups (``kv_groups``); by default one full-attention group.
    ``tables[seq_id]`` is the first group's table (a full-attention one where the model has any),
    ``group_tables[seq_id]`` every group's."""

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True,
                 groups: tuple[KVGroup, ...] = (KVGroup(0, ()),)):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.windows = tuple(g.window for g in groups)
        self.layer_groups = layer_groups(groups)  # what every batch tells the model
        # What a sliding table holds for a block it released: one past the pool, a block the runner allocates beside
        # it (on CUDA, the graphs' sink) and that a kernel reads, if at all, only under its window mask.
        self.null_block = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # blocks holding nothing reusable
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: least recently used first
        self._refs = [0] * num_blocks
        self._block_hash: dict[int, tuple[int, bytes]] = {}  # cached block -> (its group, its hash)
        self._cached: list[dict[bytes, int]] = [{} for _ in groups]  # per group: hash -> cached block
        self._hashes: dict[str, list[bytes]] = {}  # per sequence: hashes of its leading full blocks
        self._registered: dict[str, int] = {}  # per sequence: how many of its leading blocks are cached
        self._roots: dict[str, bytes] = {}  # per sequence: what its chain starts from (its adapter's fingerprint)
        self.tables: dict[str, list[int]] = {}
        self.group_tables: dict[str, list[list[int]]] = {}

    @property
    def num_free(self) -> int:
        """The free-blocks gauge: blocks a sequence can take now, cached-but-unreferenced ones included."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered under a hash (referenced or not)."""
        return sum(map(len, self._cached))

    def capacity_tokens(self, limit: int) -> int:
        """The most tokens (up to ``limit``) one sequence alone can hold: its sliding groups keep only their windows,
        so with a full-attention group this is about num_blocks / (full groups) blocks, without one ``limit``."""
        lo, hi = 0, limit
        while lo < hi:  # the largest n with blocks_held(n) <= num_blocks (monotone in n)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if blocks_held(self.windows, self.block_size, mid) <= self.num_blocks else (lo, mid - 1)
        return lo

    def blocks_needed(self, seq_id: str, n_tokens: int) -> int:
        """Extra blocks ``seq_id`` needs to hold ``n_tokens`` tokens in total (the same number in every group)."""
        have = len(self.tables.get(seq_id, ()))
        return len(self.windows) * max(0, -(-n_tokens // self.block_size) - have)

    def can_grow(self, seq_id: str, n_tokens: int) -> bool:
        return self.blocks_needed(seq_id, n_tokens) <= self.num_free

    def tokens_fit(self, seq_id: str) -> int:
        """How many tokens ``seq_id``'s tables could cover in total with every free block."""
        return (len(self.tables.get(seq_id, ())) + self.num_free // len(self.windows)) * self.block_size

    def grow(self, seq_id: str, n_tokens: int) -> list[int]:
        """Make ``seq_id``'s tables cover ``n_tokens`` tokens; its first table. Raises MemoryError when too few
        blocks are free."""
        need = self.blocks_needed(seq_id, n_tokens)
        if need > self.num_free:
            raise MemoryError(f"need {need} KV blocks, {self.num_free} free")
        tables = self._tables(seq_id)
        for table in tables:
            table.extend(self._take() for _ in range(need // len(tables)))
        return tables[0]

    def _tables(self, seq_id: str) -> list[list[int]]:
        if seq_id not in self.group_tables:
            self.group_tables[seq_id] = [[] for _ in self.windows]
            self.tables[seq_id] = self.group_tables[seq_id][0]
        return self.group_tables[seq_id]

    def _take(self) -> int:
        """A fresh block: from the plain free list, else the least recently used cached one, evicted."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            group, h = self._block_hash.pop(block)
            del self._cached[group][h]
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

    def _first_needed(self, window: int, position: int) -> int:
        """The first block a group of ``window`` (0: full) needs for tokens computed from ``position`` on: the one
        holding the oldest key the token at ``position`` attends to."""
        return max(0, (position - window + 1) // self.block_size) if window else 0

    def _hit_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of a sequence whose block hashes are ``hashes`` the cache can serve (module
        docstring): every full group's leading run, shortened until each sliding group has the window before it."""
        hit = len(hashes)
        for g, window in enumerate(self.windows):
            if not window:
                hit = next((i for i, h in enumerate(hashes[:hit]) if h not in self._cached[g]), hit)
        sliding: list[tuple[int, list[int]]] = []  # (window, [k]: the last uncached block below k, -1 for none)
        for g, window in enumerate(self.windows):
            if window:
                last = [-1]
                for i, h in enumerate(hashes[:hit]):
                    last.append(last[-1] if h in self._cached[g] else i)
                sliding.append((window, last))
        while hit and any(last[hit] >= self._first_needed(window, hit * self.block_size) for window, last in sliding):
            hit -= 1
        return hit

    def match_prefix(self, seq_id: str, prompt: list[int], output: list[int], salt: bytes = b"") -> int:
        """Start ``seq_id``'s (empty) tables with the longest run of cached blocks that hold the leading tokens of
        ``prompt + output``; the number of tokens whose K/V it thereby has. At least one token is always left to
        compute: its logits are what the next step samples from. ``salt`` starts the sequence's hash chain (its
        LoRA adapter's fingerprint): only blocks computed with the same salt match."""
        if self.tables.get(seq_id):
            raise ValueError(f"{seq_id!r} already holds blocks")
        if salt:
            self._roots[seq_id] = salt
        tables = self._tables(seq_id)
        hit = 0
        if self.caching:
            hashes = self._chain(seq_id, prompt, output, (len(prompt) + len(output) - 1) // self.block_size)
            hit = self._hit_blocks(hashes)
            for g, (window, table) in enumerate(zip(self.windows, tables, strict=True)):
                first = self._first_needed(window, hit * self.block_size)
                table.extend([self.null_block] * first)
                for h in hashes[first:hit]:
                    block = self._cached[g][h]
                    if self._refs[block] == 0:
                        del self._evictable[block]
                    self._refs[block] += 1
                    table.append(block)
        self._registered[seq_id] = hit
        return hit * self.block_size

    def register(self, seq_id: str, prompt: list[int], output: list[int], num_computed: int) -> None:
        """Cache every block of ``seq_id`` that the first ``num_computed`` of its tokens ``prompt + output`` fill
        (their K/V are written), then release each sliding group's blocks that no token from ``num_computed`` on
        can attend to (they stay cached, as any freed block). A block whose hash another block of its group already
        holds stays private (it is freed like an uncached one)."""
        n_full = num_computed // self.block_size
        done = self._registered.get(seq_id, 0)
        tables = self.group_tables[seq_id]
        if self.caching and n_full > done:
            for i, h in enumerate(self._chain(seq_id, prompt, output, n_full)[done:], start=done):
                for g, (cached, table) in enumerate(zip(self._cached, tables, strict=True)):
                    if h not in cached:
                        cached[h] = table[i]
                        self._block_hash[table[i]] = (g, h)
            self._registered[seq_id] = n_full
        for window, table in zip(self.windows, tables, strict=True):
            # Released entries are a leading run of null blocks: walk back from the first block still needed.
            first = i = self._first_needed(window, num_computed)
            while i > 0 and table[i - 1] != self.null_block:
                i -= 1
            # back to front, as free() does: the later of them are evicted first
            self._release(table[i:first])
            table[i:first] = [self.null_block] * (first - i)

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        """Flat slot indices (``block * block_size + offset``) of token positions ``start..end-1`` of a table."""
        bs = self.block_size
        return [table[t // bs] * bs + t % bs for t in range(start, end)]

    def truncate(self, seq_id: str, n_tokens: int) -> int:
        """Shrink ``seq_id``'s tables to the blocks that ``n_tokens`` tokens fill (the rollback of rejected
        speculative slots); the number released. Only blocks past every registered (cached) one may go."""
        keep = -(-n_tokens // self.block_size)
        if keep < self._registered.get(seq_id, 0):
            raise ValueError(f"cannot truncate {seq_id!r} below its cached blocks")
        released = 0
        for table in self.group_tables[seq_id]:
            released += self._release(table[keep:])
            del table[keep:]
        return released

    def _release(self, blocks: list[int]) -> int:
        """Drop one reference to each of ``blocks`` (null entries skipped); the number of blocks released."""
        n = 0
        for block in reversed(blocks):
            if block == self.null_block:
                continue
            n += 1
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._block_hash:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        return n

    def free(self, seq_id: str) -> int:
        """Release every block of ``seq_id``; the number released. A block nobody else references goes to the free
        list, or, when cached, to the most recently used end of the eviction list; each table is released back to
        front, so a sequence's later blocks are evicted before its earlier ones, which more requests share."""
        self.tables.pop(seq_id, None)
        tables = self.group_tables.pop(seq_id, [])
        self._hashes.pop(seq_id, None)
        self._registered.pop(seq_id, None)
        self._roots.pop(seq_id, None)
        return sum(self._release(table) for table in tables)
