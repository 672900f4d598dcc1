"""The standard gRPC health service (grpc.health.v1.Health: Check and Watch) for genserve.

Two places answer it:
- on the Serve gRPC port (9000), every app's deployment has a `Check` method, reached with the metadata
  `application: <app>`: SERVING for "" and for its own service name while its model can take requests;
- on the health port (GENSERVE_HEALTH_PORT, default 9001) a small gRPC server inside the `health` app answers
  clients that send no metadata at all (Kubernetes gRPC probes): a service is SERVING while its application is
  RUNNING in Ray Serve, and "" is SERVING while all four are.
Unknown service names answer NOT_FOUND, as the health protocol asks. While the stack drains
(services/common/drain.py) every answer is NOT_SERVING.
Watch is served by the health gateway only (the health port, and `application: health` on 9000): a model app's
replica counts each open stream against its max_ongoing_requests (2 for diffusion), so a watcher there would hold
capacity meant for work. Watch sends the status at once, then each change (looked at every WATCH_POLL_S); an
unknown name gets SERVICE_UNKNOWN and the stream stays open, as the protocol asks. It ends when the stack stops,
after its drain.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from . import drain
from .errors import NotFound

logger = logging.getLogger("ray.serve")

# gRPC service name -> Ray Serve application name.
SERVICES = {
    "genserve.v1.TextGeneration": "text",
    "genserve.v1.ImageGan": "gan",
    "genserve.v1.Vae": "vae",
    "genserve.v1.Diffusion": "diffusion",
}
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
WATCH_POLL_S = 1.0
# The health port's server holds a thread per Watch stream; past this many, Watch answers RESOURCE_EXHAUSTED and
# Check keeps threads of its own.
MAX_WATCHERS = 8
# serve.status() is a controller round trip; probes arrive every few seconds, so a short cache is plenty fresh.
STATUS_TTL_S = 1.0


def check(request: health_pb2.HealthCheckRequest, service: str, serving: bool) -> health_pb2.HealthCheckResponse:
    """The answer of one app for its own gRPC service name (or "")."""
    if request.service not in ("", service):
        raise NotFound(f"service: unknown service {request.service!r} on this application")
    draining = drain.watch().current().draining
    return health_pb2.HealthCheckResponse(status=SERVING if serving and not draining else NOT_SERVING)


def watched(status: Callable[[], int], state: drain.DrainState) -> int:
    """What Watch reports: `status()` (which raises NotFound for an unknown name), NOT_SERVING while draining."""
    try:
        now = status()
    except NotFound:
        return SERVICE_UNKNOWN
    return NOT_SERVING if state.draining and now == SERVING else now


async def watch_status(status: Callable[[], Awaitable[Callable[[], int]]]
                       ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
    """Watch on the health gateway's deployment: `await status()` gives the status to report now (see `watched`)."""
    last = None
    while True:
        state = drain.watch().current()
        now = watched(await status(), state)
        if now != last:
            yield health_pb2.HealthCheckResponse(status=now)
            last = now
        if state.stopping:
            return
        await asyncio.sleep(WATCH_POLL_S)


def status_of(service: str, app_running: dict[str, bool]) -> int:
    """The health status of `service` ("" = all) given which applications are RUNNING."""
    if service == "":
        return SERVING if all(app_running.get(app, False) for app in SERVICES.values()) else NOT_SERVING
    if service not in SERVICES:
        raise NotFound(f"service: unknown service {service!r}")
    return SERVING if app_running.get(SERVICES[service], False) else NOT_SERVING


class ServeStatusCache:
    """Which Serve applications are RUNNING, read from the controller at most once per STATUS_TTL_S."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._running: dict[str, bool] = {}

    def running(self) -> dict[str, bool]:
        from ray import serve

        with self._lock:
            if time.monotonic() - self._at > STATUS_TTL_S:
                try:
                    apps = serve.status().applications
                    self._running = {name: app.status == "RUNNING" for name, app in apps.items()}
                except Exception:  # the controller may be restarting: report NOT_SERVING, never crash a probe
                    logger.warning("health: serve.status() failed", exc_info=True)
                    self._running = {}
                self._at = time.monotonic()
            return dict(self._running)


class _HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, cache: ServeStatusCache):
        self._cache = cache
        self._watchers = threading.BoundedSemaphore(MAX_WATCHERS)

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext):
        try:
            status = status_of(request.service, self._cache.running())
        except NotFound as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        draining = drain.watch().current().draining
        return health_pb2.HealthCheckResponse(status=NOT_SERVING if draining else status)

    def Watch(self, request: health_pb2.HealthCheckRequest,
              context: grpc.ServicerContext) -> Iterator[health_pb2.HealthCheckResponse]:
        if not self._watchers.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"at most {MAX_WATCHERS} Watch streams at a time")
        try:
            last = None
            while context.is_active():
                state = drain.watch().current()
                status = watched(lambda: status_of(request.service, self._cache.running()), state)
                if status != last:
                    yield health_pb2.HealthCheckResponse(status=status)
                    last = status
                if state.stopping:
                    return
                time.sleep(WATCH_POLL_S)
        finally:
            self._watchers.release()


def start_health_server(host: str, port: int, cache: ServeStatusCache) -> grpc.Server:
    """A plain gRPC server (own threads, no Serve proxy) answering Health/Check without metadata."""
    # No SO_REUSEPORT: a second stack on the same port must fail loudly, not share probes with the first.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_WATCHERS + 2), options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(_HealthServicer(cache), server)
    # Reflection, as on the Serve proxy's port: grpcurl can list and call Health here without the .proto.
    reflection.enable_server_reflection([health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                         reflection.SERVICE_NAME], server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise RuntimeError(f"health port {host}:{port} is in use")
    server.start()
    return server
