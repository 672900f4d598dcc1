"""Dynamic batching for the one-shot image apps: concurrent requests merged into one model call.

A handler submits its request's model input (a GAN's latents, a VAE's images or latents) and awaits its own slice of
the output. The batcher's loop takes the first waiting item, then keeps taking items until the batch holds
`max_size` units (images, not requests) or `wait_s` has passed since that first item, runs the model once on the
whole batch in a worker thread and hands every caller its own result. While a batch runs the next one fills, so
under load the wait is hidden behind the model call (Triton's dynamic batcher; Ray Serve's `@serve.batch` does the
same, but only inside a replica, so it cannot be tested in-process, and it sizes batches in requests unless given a
size function).

Each item stays the caller's own: its noise is drawn from its own seed before it is submitted, and the models are
batch-invariant on the CPU (kernels/cpu_conv.py), so a batched request's output is bit-identical to the same
request run alone. Requests are validated before they are submitted, so one bad request never fails the others;
an exception from the model call itself reaches every caller of that batch. A caller cancelled before its batch
starts is left out of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from pydantic import Field

from genserve.services.common.builder import AppArgs

T = TypeVar("T")
R = TypeVar("R")


class BatchArgs(AppArgs):
    """The serve-config `args` of an app that batches (gan, vae): docs/deploy.md."""

    max_batch_images: int = Field(32, ge=1, le=4096)  # images per model call; larger requests are split
    batch_wait_s: float = Field(0.005, ge=0, le=1, allow_inf_nan=False)  # how long a first request waits for others


@dataclass
class _Waiting(Generic[T]):
    item: T
    size: int
    future: asyncio.Future
    since: float = field(default_factory=time.perf_counter)


class Batcher(Generic[T, R]):
    """Merges concurrent `submit(item)` calls into `run(items) -> results` calls of at most `max_size` units.

    `size(item)` counts an item's units (its images); an item over `max_size` is refused (split it first).
    `on_batch(units, waits)`, if given, sees each batch: its size and every item's seconds from submit to the start
    of its model call (the metrics, services/common/metrics.py)."""

    def __init__(self, run: Callable[[list[T]], list[R]], size: Callable[[T], int], max_size: int, wait_s: float,
                 on_batch: Callable[[int, list[float]], None] | None = None) -> None:
        if max_size < 1 or wait_s < 0:
            raise ValueError(f"need max_size >= 1 and wait_s >= 0, got {max_size} and {wait_s}")
        self.run, self.size, self.max_size, self.wait_s, self.on_batch = run, size, max_size, wait_s, on_batch
        self._queue: asyncio.Queue[_Waiting[T]] | None = None
        self._carry: _Waiting[T] | None = None  # the item that did not fit the last batch: it opens the next
        self._loop_task: asyncio.Task | None = None

    async def submit(self, item: T) -> R:
        units = self.size(item)
        if not 1 <= units <= self.max_size:
            raise ValueError(f"an item of {units} units does not fit a batch of at most {self.max_size}")
        if self._loop_task is None:
            self._queue = asyncio.Queue()
            self._loop_task = asyncio.get_running_loop().create_task(self._serve())
        waiting = _Waiting(item, units, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(waiting)
        return await waiting.future

    async def close(self) -> None:
        """Stop the loop (tests; a replica simply exits)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None

    async def _serve(self) -> None:
        while True:
            batch = await self._collect()
            await self._run(batch)

    async def _collect(self) -> list[_Waiting[T]]:
        assert self._queue is not None
        first, self._carry = self._carry or await self._queue.get(), None
        batch, units = [first], first.size
        deadline = first.since + self.wait_s
        while units < self.max_size:
            try:
                if self._queue.empty():
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    nxt = await asyncio.wait_for(self._queue.get(), left)
                else:
                    nxt = self._queue.get_nowait()
            except TimeoutError:
                break
            if units + nxt.size > self.max_size:
                self._carry = nxt
                break
            batch.append(nxt)
            units += nxt.size
        return [w for w in batch if not w.future.done()]  # a cancelled caller is left out

    async def _run(self, batch: list[_Waiting[T]]) -> None:
        if not batch:
            return
        start = time.perf_counter()
        if self.on_batch is not None:
            self.on_batch(sum(w.size for w in batch), [start - w.since for w in batch])
        try:
            results: list[Any] = await asyncio.to_thread(self.run, [w.item for w in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"the batch function returned {len(results)} results for {len(batch)} items")
        except Exception as exc:  # the model call failed: every caller of this batch gets the error
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(exc)
            return
        for w, result in zip(batch, results, strict=True):
            if not w.future.done():
                w.future.set_result(result)


def rows_by_shape(fn: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, ...]],
                  tensors: list[torch.Tensor]) -> list[Any]:
    """`fn` called once per group of `tensors` that share a shape past dim 0 (concatenated along dim 0), and each
    tensor's own rows of the answer back, in order: a tensor, or a tuple when `fn` returns one. This is how a batch
    of requests for images of different sizes (an AutoencoderKL takes any) still runs one call per size."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(tuple(t.shape[1:]), []).append(i)
    out: list[Any] = [None] * len(tensors)
    for members in groups.values():
        answer = fn(torch.cat([tensors[i] for i in members]))
        sizes = [len(tensors[i]) for i in members]
        parts = (list(zip(*(a.split(sizes) for a in answer), strict=True)) if isinstance(answer, tuple)
                 else answer.split(sizes))
        for i, part in zip(members, parts, strict=True):
            out[i] = part
    return out
