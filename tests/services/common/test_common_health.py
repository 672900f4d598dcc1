"""Health answers: per-app Check, the aggregate from application states, and the no-metadata server."""

from __future__ import annotations

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import NotFound
from services.common.health import NOT_SERVING, SERVICES, SERVING, check, start_health_server, status_of

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
