"""The drain: the board's state and count of calls in flight, a replica's watch, and what the handler wrappers do
with it (UNAVAILABLE for new calls, CANCELLED past the deadline, probes and handle calls let through)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from genserve.services.common import drain
from genserve.services.common.auth import Access
from genserve.services.common.drain import CUT_MESSAGE, DRAINING_MESSAGE, FRESH_S, DrainBoard, DrainState, DrainWatch
from genserve.services.common.errors import Cancelled
from genserve.services.common.gate import Gate
from genserve.services.common.metrics import ServiceMetrics
from genserve.services.common.rpc import StatusSet, streaming, unary
from genserve.v1 import text_pb2


class FakeContext:
    """The part of Ray Serve's RayServegRPCContext the wrapper uses."""

    def __init__(self) -> None:
        self.code, self.details = None, None

    def request_id(self) -> str:
        return "req-1"

    def invocation_metadata(self) -> tuple:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def reporter(board: DrainBoard, name: str = "replica-1"):
    return lambda in_flight: board.report(name, in_flight)


def test_the_board_drains_once_with_one_deadline() -> None:
    board = DrainBoard()
    assert not board.state().draining and not board.state().cut(1e12)
    state = board.start(30, now=100.0)
    assert state == DrainState("draining", 130.0)
    assert board.start(5, now=110.0).deadline == 130.0  # a second SIGTERM keeps the first deadline
    assert not state.cut(129.9) and state.cut(130.0)
    stopping = board.stop()
    assert stopping.stopping and stopping.draining and stopping.deadline == 130.0


def test_pending_counts_live_replicas_and_those_not_heard_from_since_the_drain() -> None:
    board = DrainBoard()
    board.report("idle-before", 0, now=99.0)
    board.report("busy-before", 3, now=99.5)
    board.report("gone", 7, now=99.0 - FRESH_S - 1)
    board.start(30, now=100.0)
    # Reports from before the drain: the idle one may have admitted a call since, so it counts as one.
    assert board.pending(now=100.0) == 1 + 3
    board.report("idle-before", 0, now=100.2)
    board.report("busy-before", 2, now=100.3)
    assert board.pending(now=100.5) == 2
    board.report("busy-before", 0, now=101.0)
    assert board.pending(now=101.0) == 0


def test_the_watch_reports_its_calls_and_takes_the_state() -> None:
    board = DrainBoard()
    watch = DrainWatch(reporter(board))

    async def one_call() -> None:
        with watch.call():
            assert watch.poll()
            assert board._reports["replica-1"][0] == 1
            board.start(30)
            watch.poll()

    asyncio.run(one_call())
    assert watch.state.draining and watch.in_flight == 0
    assert DrainWatch(lambda n: None).poll() is False  # no board: nothing to watch


def test_past_the_deadline_the_watch_cancels_its_calls_as_cancelled() -> None:
    board = DrainBoard()
    watch = DrainWatch(reporter(board))

    async def scenario() -> tuple[BaseException, BaseException]:
        started = asyncio.Event()

        async def call() -> None:
            with watch.call():
                started.set()
                await asyncio.sleep(60)

        cut, other = asyncio.ensure_future(call()), asyncio.ensure_future(call())
        await started.wait()
        await asyncio.sleep(0)
        other.cancel()  # a client that went away: not the drain's doing
        (gone,) = await asyncio.gather(other, return_exceptions=True)
        board.start(0)
        watch.poll()
        (ended,) = await asyncio.gather(cut, return_exceptions=True)
        return ended, gone

    cut, other = asyncio.run(scenario())
    assert isinstance(cut, Cancelled) and str(cut) == CUT_MESSAGE
    assert isinstance(other, asyncio.CancelledError)
    assert watch.in_flight == 0


class Slow:
    def __init__(self) -> None:
        self.metrics = ServiceMetrics("test")
        self.gate = Gate(Access())  # no keys: this host's calls are served

    @unary(text_pb2.TextRequest, text_pb2.TextResponse)
    async def Generate(self, request: text_pb2.TextRequest) -> text_pb2.TextResponse:
        await asyncio.sleep(float(request.prompt or 0))
        return text_pb2.TextResponse(text="done")

    @streaming(text_pb2.TextRequest)
    async def GenerateStream(self, request: text_pb2.TextRequest):
        yield text_pb2.TextChunk(text="first")
        await asyncio.sleep(60)
        yield text_pb2.TextChunk(text="never")

    @unary(health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse)
    async def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def board(monkeypatch: pytest.MonkeyPatch) -> DrainBoard:
    """A board that this process's wrappers watch (instead of the Ray actor's)."""
    board = DrainBoard()
    watch = DrainWatch(reporter(board))
    watch._polled.set()
    watch._thread = object()  # polled by the test, not by a thread
    monkeypatch.setattr(drain, "watch", lambda: watch)
    return board


def test_while_draining_a_client_call_is_unavailable_but_probes_and_handle_calls_pass(board: DrainBoard) -> None:
    service = Slow()
    board.start(30)
    drain.watch().poll()
    context = FakeContext()
    reply = asyncio.run(service.Generate(text_pb2.TextRequest(), grpc_context=context))
    assert reply == text_pb2.TextResponse()
    assert (context.code, context.details) == (grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
    assert asyncio.run(service.Generate(text_pb2.TextRequest())).text == "done"  # a deployment-handle call
    probe = FakeContext()
    assert asyncio.run(service.Check(health_pb2.HealthCheckRequest(), grpc_context=probe)).status == 1
    assert probe.code is None
    assert service.metrics.ongoing == 0


def test_calls_in_flight_finish_and_past_the_deadline_end_cancelled(board: DrainBoard) -> None:
    service = Slow()

    async def scenario() -> tuple[text_pb2.TextResponse, FakeContext, text_pb2.TextResponse, FakeContext, list]:
        quick_ctx, slow_ctx, stream_ctx, chunks = FakeContext(), FakeContext(), FakeContext(), []

        async def consume() -> None:
            async for chunk in service.GenerateStream(text_pb2.TextRequest(), grpc_context=stream_ctx):
                chunks.append(chunk.text)

        quick = asyncio.ensure_future(service.Generate(text_pb2.TextRequest(prompt="0.05"), grpc_context=quick_ctx))
        slow = asyncio.ensure_future(service.Generate(text_pb2.TextRequest(prompt="60"), grpc_context=slow_ctx))
        stream = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)
        board.start(0.1)
        drain.watch().poll()  # draining, deadline not reached: calls run on
        assert drain.watch().in_flight == 3
        await asyncio.sleep(0.15)
        drain.watch().poll()  # past the deadline
        results = await asyncio.gather(quick, slow, stream, return_exceptions=True)
        assert isinstance(results[2], StatusSet)
        return results[0], quick_ctx, results[1], slow_ctx, [chunks, stream_ctx]

    quick, quick_ctx, slow, slow_ctx, (chunks, stream_ctx) = asyncio.run(scenario())
    assert quick.text == "done" and quick_ctx.code is None
    assert slow == text_pb2.TextResponse()
    assert (slow_ctx.code, slow_ctx.details) == (grpc.StatusCode.CANCELLED, CUT_MESSAGE)
    assert chunks == ["first"]
    assert (stream_ctx.code, stream_ctx.details) == (grpc.StatusCode.CANCELLED, CUT_MESSAGE)
    assert drain.watch().in_flight == 0 and service.metrics.ongoing == 0


def test_drain_seconds_come_from_the_flag_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GENSERVE_DRAIN_SECONDS", raising=False)
    assert drain.drain_seconds() == drain.DRAIN_SECONDS
    monkeypatch.setenv("GENSERVE_DRAIN_SECONDS", "7.5")
    assert drain.drain_seconds() == 7.5
    assert drain.drain_seconds(2.0) == 2.0
