"""Stall detection: work waits and no engine step finishes for stall_s -> stalled; idle or stepping -> not."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from pydantic import ValidationError

from genserve.services.text.engine.async_engine import AsyncLLMEngine
from genserve.services.text.engine.params import SamplingParams
from genserve.services.text.engine.progress import DEFAULT_STALL_S, StallDetector
from genserve.services.text.settings import TextArgs


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_clock_starts_when_work_arrives_at_an_idle_engine() -> None:
    clock = Clock()
    detector = StallDetector(10, clock)
    clock.now += 3600  # idle for an hour: nothing waits, nothing is stalled
    detector.idle()
    assert not detector.stalled(has_work=False)
    detector.work_arrived()
    clock.now += 9
    assert not detector.stalled(has_work=True)
    clock.now += 2
    assert detector.stalled(has_work=True)
    detector.stepped()
    assert not detector.stalled(has_work=True)
    detector.work_arrived()  # more work while busy: the clock keeps running from the last step
    clock.now += 11
    assert detector.stalled(has_work=True)
    assert not detector.stalled(has_work=False)


def test_stall_seconds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stall_s"):
        StallDetector(0)


class HangingEngine:
    """An LLMEngine whose step hangs until released (a wedged kernel)."""

    tokenizer = None
    grammars = None

    def __init__(self) -> None:
        self.work = False
        self.release = threading.Event()
        self.steps = 0

    def add_request(self, *args, **kwargs) -> None:
        self.work = True

    def has_work(self) -> bool:
        return self.work

    def step(self) -> int:
        self.release.wait()
        self.steps += 1
        self.work = False
        return 1

    def abort(self, request_id: str) -> bool:
        return True


def test_a_step_that_hangs_makes_the_engine_stalled_until_it_returns() -> None:
    engine = HangingEngine()
    served = AsyncLLMEngine(engine, stall_s=0.3)

    async def scenario() -> None:
        assert not served.stalled
        waiting = asyncio.ensure_future(anext(served.stream([1], SamplingParams())))
        await asyncio.sleep(0.1)
        assert not served.stalled  # waiting, but not for long yet
        await asyncio.sleep(0.4)
        assert served.stalled
        engine.release.set()
        deadline = time.monotonic() + 5
        while engine.steps == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert engine.steps == 1 and not served.stalled
        waiting.cancel()

    try:
        asyncio.run(scenario())
    finally:
        engine.release.set()
        served.shutdown()


def test_stall_seconds_is_a_serve_config_setting() -> None:
    assert TextArgs().stall_seconds == DEFAULT_STALL_S == 120.0
    assert TextArgs.model_validate({"stall_seconds": 30}).stall_seconds == 30.0
    with pytest.raises(ValidationError, match="stall_seconds"):
        TextArgs.model_validate({"stall_seconds": 0})
