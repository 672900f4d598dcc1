"""The `health` application: serves grpc.health.v1.Health (Check, Watch) on a port of its own for clients without
metadata.

Kubernetes gRPC probes cannot send the `application` metadata the Serve proxy routes by, so this one-replica
deployment runs a plain gRPC server on GENSERVE_HEALTH_PORT (default 9001). Through the proxy on 9000 with
`application: health` it answers Check and Watch for all four services, and genserve.v1.ServeStatus/GetStatus (the apps,
their replicas and state; what `genserve status` prints).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from grpc_health.v1 import health_pb2
from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve.deployment import Application

from genserve.v1 import common_pb2

from . import drain
from .gate import Gate
from .health import NOT_SERVING, ServeStatusCache, start_health_server, status_of, watch_status
from .metrics import ServiceMetrics
from .rpc import streaming, unary, unknown_rpcs

DEFAULT_HEALTH_PORT = 9001


class HealthArgs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "0.0.0.0"
    port: int | None = None


@serve.deployment(name="HealthGateway", num_replicas=1, ray_actor_options={"num_cpus": 0.01})
class HealthGateway:
    __getattr__ = unknown_rpcs
    def __init__(self, host: str, port: int):
        self.metrics = ServiceMetrics("health")
        self.gate = Gate.from_env()  # Check stays open; GetStatus takes a key like any call
        self._cache = ServeStatusCache()
        self._server = start_health_server(host, port, self._cache)

    @unary(health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse)
    async def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        running = await asyncio.to_thread(self._cache.running)
        status = status_of(request.service, running)
        draining = drain.watch().current().draining
        return health_pb2.HealthCheckResponse(status=NOT_SERVING if draining else status)

    @streaming(health_pb2.HealthCheckRequest)
    async def Watch(self, request: health_pb2.HealthCheckRequest) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        async def status() -> Callable[[], int]:
            running = await asyncio.to_thread(self._cache.running)
            return lambda: status_of(request.service, running)

        async for reply in watch_status(status):
            yield reply

    @unary(common_pb2.StatusRequest, common_pb2.StatusResponse)
    async def GetStatus(self, request: common_pb2.StatusRequest) -> common_pb2.StatusResponse:
        return await asyncio.to_thread(serve_status)

    def __del__(self) -> None:
        self._server.stop(grace=None)


def label(state: Any) -> str:
    """Ray's status enums are `str` mixins whose str() is 'Class.MEMBER'; the wire wants 'MEMBER'."""
    return str(getattr(state, "value", state))


def serve_status() -> common_pb2.StatusResponse:
    """Every application's state and its replicas by state, from the Serve controller."""
    reply = common_pb2.StatusResponse()
    for name, app in sorted(serve.status().applications.items()):
        replicas: dict[str, int] = {}
        for deployment in app.deployments.values():
            for state, count in deployment.replica_states.items():
                replicas[label(state)] = replicas.get(label(state), 0) + count
        reply.apps.add(name=name, status=label(app.status), replicas=replicas, message=app.message)
    return reply


def health_port(configured: int | None = None) -> int:
    return configured or int(os.environ.get("GENSERVE_HEALTH_PORT", DEFAULT_HEALTH_PORT))


def build(args: dict[str, Any] | None = None) -> Application:
    parsed = HealthArgs.model_validate(args or {})
    return HealthGateway.bind(parsed.host, health_port(parsed.port))
