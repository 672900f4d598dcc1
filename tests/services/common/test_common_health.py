"""Health answers: per-app Check, the aggregate from application states, and the no-metadata server."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genserve.services.common import drain, health
from genserve.services.common.drain import DrainBoard, DrainWatch
from genserve.services.common.errors import NotFound
from genserve.services.common.health import (
    NOT_SERVING,
    SERVICE_UNKNOWN,
    SERVICES,
    SERVING,
    check,
    start_health_server,
    status_of,
)

ALL_RUNNING = {app: True for app in SERVICES.values()}


def test_app_check_answers_its_service_and_the_empty_name() -> None:
    ask = health_pb2.HealthCheckRequest
    assert check(ask(service="genserve.v1.Vae"), "genserve.v1.Vae", serving=True).status == SERVING
    assert check(ask(service=""), "genserve.v1.Vae", serving=False).status == NOT_SERVING
    with pytest.raises(NotFound, match="genserve.v1.Diffusion"):
        check(ask(service="genserve.v1.Diffusion"), "genserve.v1.Vae", serving=True)


def test_status_follows_the_application_state() -> None:
    assert status_of("", ALL_RUNNING) == SERVING
    assert all(status_of(service, ALL_RUNNING) == SERVING for service in SERVICES)
    deploying = {**ALL_RUNNING, "diffusion": False}
    assert status_of("", deploying) == NOT_SERVING
    assert status_of("genserve.v1.Diffusion", deploying) == NOT_SERVING
    assert status_of("genserve.v1.TextGeneration", deploying) == SERVING
    assert status_of("genserve.v1.TextGeneration", {}) == NOT_SERVING
    with pytest.raises(NotFound):
        status_of("genserve.v1.Unknown", ALL_RUNNING)


class FixedStatus:
    def __init__(self, running: dict[str, bool]):
        self._running = running

    def running(self) -> dict[str, bool]:
        return self._running


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_server_answers_clients_without_metadata() -> None:
    port = free_port()
    server = start_health_server("127.0.0.1", port, FixedStatus({**ALL_RUNNING, "gan": False}))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            ask = health_pb2.HealthCheckRequest
            assert stub.Check(ask(service="genserve.v1.Vae"), timeout=5).status == SERVING
            assert stub.Check(ask(service="genserve.v1.ImageGan"), timeout=5).status == NOT_SERVING
            assert stub.Check(ask(service=""), timeout=5).status == NOT_SERVING
            with pytest.raises(grpc.RpcError) as info:
                stub.Check(ask(service="nope"), timeout=5)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop(grace=None)


def test_health_server_refuses_a_busy_port() -> None:
    port = free_port()
    first = start_health_server("127.0.0.1", port, FixedStatus(ALL_RUNNING))
    try:
        with pytest.raises(RuntimeError, match="in use"):
            start_health_server("127.0.0.1", port, FixedStatus(ALL_RUNNING))
    finally:
        first.stop(grace=None)


@pytest.fixture
def board(monkeypatch: pytest.MonkeyPatch) -> DrainBoard:
    """A drain board this process watches (instead of the Ray actor), polled at each answer; Watch looks every 10 ms."""
    board = DrainBoard()
    watch = DrainWatch(lambda in_flight: board.report("replica", in_flight))
    watch._polled.set()
    watch._thread = object()
    monkeypatch.setattr(watch, "current", lambda: (watch.poll(), watch.state)[1])
    monkeypatch.setattr(drain, "watch", lambda: watch)
    monkeypatch.setattr(health, "WATCH_POLL_S", 0.01)
    return board


def test_while_draining_check_says_not_serving(board: DrainBoard) -> None:
    ask = health_pb2.HealthCheckRequest
    assert check(ask(service=""), "genserve.v1.Vae", serving=True).status == SERVING
    board.start(30)
    assert check(ask(service=""), "genserve.v1.Vae", serving=True).status == NOT_SERVING


def test_gateway_watch_sends_changes_then_ends_when_the_stack_stops(board: DrainBoard) -> None:
    running = dict(ALL_RUNNING)

    async def status():
        return lambda: status_of("genserve.v1.Diffusion", dict(running))

    async def scenario() -> list[int]:
        seen: list[int] = []
        async for reply in health.watch_status(status):
            seen.append(reply.status)
            if len(seen) == 1:
                running["diffusion"] = False  # e.g. a replica being replaced
            elif len(seen) == 2:
                running["diffusion"] = True
            elif len(seen) == 3:
                board.start(30)
            else:
                board.stop()
        return seen

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == [SERVING, NOT_SERVING, SERVING, NOT_SERVING]


def test_gateway_watch_of_an_unknown_name_says_service_unknown(board: DrainBoard) -> None:
    async def status():
        return lambda: status_of("genserve.v1.Nope", ALL_RUNNING)

    async def first() -> int:
        return (await anext(health.watch_status(status))).status

    assert asyncio.run(first()) == SERVICE_UNKNOWN


def test_health_server_watch_sees_serving_then_not_serving_on_drain(board: DrainBoard) -> None:
    port = free_port()
    server = start_health_server("127.0.0.1", port, FixedStatus(ALL_RUNNING))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            stream = stub.Watch(health_pb2.HealthCheckRequest(service="genserve.v1.TextGeneration"), timeout=10)
            assert next(stream).status == SERVING
            board.start(30)
            assert next(stream).status == NOT_SERVING
            board.stop()
            assert list(stream) == []  # the stream ends once the stack stops
            unknown = stub.Watch(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
            assert next(unknown).status == SERVICE_UNKNOWN
            unknown.cancel()
    finally:
        server.stop(grace=None)
