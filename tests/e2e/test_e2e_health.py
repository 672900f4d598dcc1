"""grpc.health.v1.Health/Check for every service: through the proxy with the `application` metadata, and on the
health port with no metadata at all (what a Kubernetes gRPC probe sends)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genserve.services.common.health import SERVICES

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING


def check(address: str, service: str, metadata: tuple | None) -> health_pb2.HealthCheckResponse:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), metadata=metadata, timeout=10)


@pytest.mark.parametrize(("service", "app"), sorted(SERVICES.items()))
def test_each_app_serves_its_service_and_the_empty_name(stack, service: str, app: str) -> None:
    metadata = (("application", app),)
    assert check(stack.address, service, metadata).status == SERVING
    assert check(stack.address, "", metadata).status == SERVING


@pytest.mark.parametrize("service", ["", *sorted(SERVICES)])
def test_health_port_answers_without_metadata(stack, service: str) -> None:
    assert check(stack.health_address, service, None).status == SERVING


@pytest.mark.parametrize("service", ["", *sorted(SERVICES)])
def test_health_app_answers_through_the_proxy(stack, service: str) -> None:
    assert check(stack.address, service, (("application", "health"),)).status == SERVING


@pytest.mark.parametrize(
    ("address_of", "metadata"),
    [("health_address", None), ("address", (("application", "text"),)), ("address", (("application", "health"),))],
)
def test_unknown_service_is_not_found(stack, address_of: str, metadata: tuple | None) -> None:
    with pytest.raises(grpc.RpcError) as info:
        check(getattr(stack, address_of), "genserve.v1.Nope", metadata)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "genserve.v1.Nope" in info.value.details()


def test_proxy_without_metadata_is_not_found(stack) -> None:
    """Documented: the proxy routes by `application`; probes without metadata use the health port."""
    with pytest.raises(grpc.RpcError) as info:
        check(stack.address, "", None)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(("address_of", "app"), [("address", "health"), ("health_address", None)])
def test_watch_sends_the_status_at_once_and_service_unknown_for_an_unknown_name(stack, address_of: str,
                                                                             app: str | None) -> None:
    metadata = (("application", app),) if app else None
    with grpc.insecure_channel(getattr(stack, address_of)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), metadata=metadata, timeout=20)
        assert next(watch).status == SERVING
        watch.cancel()
        unknown = stub.Watch(health_pb2.HealthCheckRequest(service="genserve.v1.Nope"), metadata=metadata, timeout=20)
        assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        unknown.cancel()
