"""Merging the streams of a request's choices into one, in arrival order, and reading a stream in batches of what
has already arrived."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index of the stream, item) as items arrive; an error in any stream ends the merge with that error, and
    closing the merge stops every stream's reader."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
            queue.put_nowait((index, _END))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
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
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def batches(items: AsyncIterator[T]) -> AsyncIterator[list[T]]:
    """The items of ``items`` in lists: each holds the next item and every item that arrived while the consumer was
    busy, so a slow writer sends one message per wake-up instead of one per item, and never waits for more. An error
    in ``items`` is raised after the items before it; closing this generator stops the reader."""
    queue: asyncio.Queue[tuple[object, BaseException | None]] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in items:
                queue.put_nowait((item, None))
            queue.put_nowait((_END, None))
        except Exception as exc:
            queue.put_nowait((_END, exc))

    task = asyncio.ensure_future(pump())
    try:
        while True:
            batch, (item, error) = [], await queue.get()
            while item is not _END:
                batch.append(item)
                if queue.empty():
                    break
                item, error = queue.get_nowait()
            if batch:
                yield batch
            if item is _END:
                if error is not None:
                    raise error
                return
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
