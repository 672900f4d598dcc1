"""Merging the streams of a request's choices into one, in arrival order, and reading a stream in batches of what
has already arrived."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def _pump(key: int, stream: AsyncIterator[T], queue: asyncio.Queue[tuple[int, object]]) -> None:
    """Puts (key, item) for each item of ``stream`` on ``queue``, then (key, _END), or (key, the error) if it fails."""
    try:
        async for item in stream:
            queue.put_nowait((key, item))
        queue.put_nowait((key, _END))
    except Exception as exc:
        queue.put_nowait((key, exc))


async def _stop(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index of the stream, item) as items arrive; an error in any stream ends the merge with that error, and
    closing the merge stops every stream's reader."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(i, s, queue)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            index, item = await queue.get()
            if item is _END:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        await _stop(tasks)


async def batches(items: AsyncIterator[T]) -> AsyncIterator[list[T]]:
    """The items of ``items`` in lists: each holds the next item and every item that arrived while the consumer was
    busy, so a slow writer sends one message per wake-up instead of one per item, and never waits for more. An error
    in ``items`` is raised after the items before it; closing this generator stops the reader."""
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(0, items, queue))]
    try:
        while True:
            batch: list[T] = []
            _, item = await queue.get()
            while item is not _END and not isinstance(item, Exception):
                batch.append(item)
                if queue.empty():
                    break
                _, item = queue.get_nowait()
            if batch:
                yield batch
            if isinstance(item, Exception):
                raise item
            if item is _END:
                return
    finally:
        await _stop(tasks)
