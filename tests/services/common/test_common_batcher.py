"""The dynamic batcher (services/common/batcher.py): merging, sizes in units, the wait, errors, cancellation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from pydantic import ValidationError

from genserve.services.common.batcher import BatchArgs, Batcher, rows_by_shape


class Recorder:
    """A batch function that doubles its items' values and remembers every batch it saw."""

    def __init__(self, fail: bool = False, seconds: float = 0.0) -> None:
        self.batches: list[list[list[int]]] = []
        self.fail, self.seconds = fail, seconds

    def __call__(self, items: list[list[int]]) -> list[list[int]]:
        self.batches.append(items)
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("the model broke")
        return [[2 * v for v in item] for item in items]


def run(coro):
    return asyncio.run(coro)


def test_concurrent_items_share_one_call_and_each_gets_its_own_result():
    calls, seen = Recorder(), []

    async def main():
        batcher = Batcher(calls, len, max_size=32, wait_s=0.2, on_batch=lambda n, waits: seen.append((n, waits)))
        out = await asyncio.gather(*(batcher.submit([i] * (i + 1)) for i in range(5)))
        await batcher.close()
        return out

    assert run(main()) == [[2 * i] * (i + 1) for i in range(5)]
    assert [len(b) for b in calls.batches] == [5]
    assert seen[0][0] == 15 and len(seen[0][1]) == 5  # units = images, one wait per request


def test_a_batch_never_holds_more_units_than_max_size_and_keeps_arrival_order():
    calls = Recorder()

    async def main():
        batcher = Batcher(calls, len, max_size=5, wait_s=0.2)
        out = await asyncio.gather(*(batcher.submit([i] * n) for i, n in enumerate([3, 2, 3, 1, 4])))
        await batcher.close()
        return out

    assert run(main()) == [[2 * i] * n for i, n in enumerate([3, 2, 3, 1, 4])]
    assert [[len(item) for item in b] for b in calls.batches] == [[3, 2], [3, 1], [4]]


def test_an_item_larger_than_a_batch_is_refused():
    async def main():
        batcher = Batcher(Recorder(), len, max_size=4, wait_s=0)
        with pytest.raises(ValueError, match="5 units"):
            await batcher.submit([0] * 5)

    run(main())


def test_a_lone_item_waits_for_company_at_most_wait_s():
    waits = []

    async def main(wait_s: float) -> float:
        batcher = Batcher(Recorder(), len, max_size=8, wait_s=wait_s, on_batch=lambda n, w: waits.extend(w))
        start = time.perf_counter()
        await batcher.submit([1])
        await batcher.close()
        return time.perf_counter() - start

    assert 0.25 <= run(main(0.25)) < 1.0 and 0.25 <= waits[-1] < 1.0
    assert run(main(0.0)) < 0.2 and waits[-1] < 0.2


def test_items_arriving_while_a_batch_runs_form_the_next_batch():
    calls = Recorder(seconds=0.3)

    async def main():
        batcher = Batcher(calls, len, max_size=8, wait_s=0.0)
        first = asyncio.ensure_future(batcher.submit([0]))
        await asyncio.sleep(0.1)  # the first batch is running
        rest = await asyncio.gather(*(batcher.submit([i]) for i in range(1, 5)))
        await batcher.close()
        return [await first, *rest]

    assert run(main()) == [[0], [2], [4], [6], [8]]
    assert [len(b) for b in calls.batches] == [1, 4]


def test_a_failing_model_call_fails_its_batch_only():
    bad, good = Recorder(fail=True), Recorder()

    async def main():
        failing = Batcher(bad, len, max_size=8, wait_s=0.1)
        results = await asyncio.gather(*(failing.submit([i]) for i in range(3)), return_exceptions=True)
        await failing.close()
        working = Batcher(good, len, max_size=8, wait_s=0.0)
        ok = await working.submit([4])
        await working.close()
        return results, ok

    results, ok = run(main())
    assert all(isinstance(r, RuntimeError) and "broke" in str(r) for r in results)
    assert ok == [8]


def test_a_caller_cancelled_before_its_batch_starts_is_left_out():
    calls, gate = Recorder(), threading.Event()

    def slow(items):
        gate.wait(5)
        return calls(items)

    async def main():
        batcher = Batcher(slow, len, max_size=8, wait_s=0.0)
        first = asyncio.ensure_future(batcher.submit([0]))
        await asyncio.sleep(0.05)  # the first batch is running and holds the model
        doomed = asyncio.ensure_future(batcher.submit([1]))
        kept = asyncio.ensure_future(batcher.submit([2]))
        await asyncio.sleep(0.05)
        doomed.cancel()
        gate.set()
        out = [await first, await kept]
        await batcher.close()
        return out

    assert run(main()) == [[0], [4]]
    assert calls.batches == [[[0]], [[2]]]


def test_rows_by_shape_runs_one_call_per_shape_and_hands_back_each_tensors_rows():
    shapes = []

    def fn(x: torch.Tensor):
        shapes.append(tuple(x.shape))
        return x * 2, x.sum(dim=(1, 2))

    a, b, c = torch.ones(2, 4, 4), torch.full((1, 8, 8), 3.0), torch.full((3, 4, 4), 5.0)
    out = rows_by_shape(fn, [a, b, c])
    assert shapes == [(5, 4, 4), (1, 8, 8)]
    assert torch.equal(out[0][0], a * 2) and torch.equal(out[1][0], b * 2) and torch.equal(out[2][0], c * 2)
    assert out[2][1].tolist() == [80.0] * 3
    assert [t.shape[0] for t in rows_by_shape(lambda x: x + 1, [a, c])] == [2, 3]


def test_batch_args_are_validated_with_the_field_named():
    assert BatchArgs().max_batch_images == 32
    with pytest.raises(ValidationError, match="max_batch_images"):
        BatchArgs(max_batch_images=0)
    with pytest.raises(ValidationError, match="batch_wait_s"):
        BatchArgs(batch_wait_s=-1)
