"""A CPU model's weights moved into one arena of 2 MiB transparent huge pages.

A CPU decode step streams every weight once, so it runs at memory bandwidth, and on 4 KiB pages it also takes a TLB
miss every 4 KiB: 37,000 of them a step for the 147 MiB issue-13 bench model. In huge pages the same step ran 11%
faster (bench/lm.py's model, batch-1 greedy decode, 2 threads: 168.6 -> 187.9 tok/s, medians of 10 interleaved
runs). Linux hands out huge pages for a region only when asked (``transparent_hugepage/enabled`` is usually
``madvise``), hence an ``madvise(MADV_HUGEPAGE)`` arena the tensors are copied into. Where the kernel gives none,
the arena is ordinary memory and nothing else changes.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

HUGE_PAGE = 2 * 2**20
ALIGN = 64  # what torch's CPU allocator gives every tensor: the vector loads of the C kernels expect no less


def _aligned(nbytes: int, to: int) -> int:
    return (nbytes + to - 1) // to * to


def move_to_huge_pages(model: nn.Module) -> mmap.mmap | None:
    """Re-home every CPU parameter and buffer of ``model`` in one huge-page arena, in place (each tensor keeps its
    Parameter object, so tied weights stay tied). Returns the arena, which must outlive the model's use, or None
    where this platform has no MADV_HUGEPAGE or the model has no CPU tensors. Call it before anything holds raw
    pointers into the weights (the fused C decode step does)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.device.type == "cpu" and t.numel()]
    if not tensors:
        return None
    size = _aligned(sum(_aligned(t.numel() * t.element_size(), ALIGN) for t in tensors), HUGE_PAGE) + HUGE_PAGE
    arena = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the copies below fault in huge pages
    memory = torch.frombuffer(arena, dtype=torch.uint8)
    offset = -memory.data_ptr() % HUGE_PAGE
    with torch.no_grad():
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            home = memory[offset:offset + nbytes].view(t.dtype).view(t.shape)
            home.copy_(t.contiguous())
            t.data = home
            offset += _aligned(nbytes, ALIGN)
    return arena
