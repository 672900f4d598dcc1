"""The door of every app: a call is admitted when its API key (or the peer rule) lets it in and its caller's rate
limits have room; what it generates is then charged to that caller (services/common/auth.py, rate_limit.py).

gRPC calls are admitted by the handler wrapper (services/common/rpc.py) from the Ray Serve gRPC context: the
`authorization` metadata and the peer the proxy saw. HTTP calls are admitted by the OpenAI-compatible app from the
header and the client address. Deployment-handle calls (`grpc_context` None) come from inside the Ray cluster, from
an app that admitted its own caller, and pass; so does grpc.health.v1, which probes call without keys. An app's
admin requests (the text app's LoadAdapter and UnloadAdapter) need an admin key whenever keys are set
(`Access.admin`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from .auth import Access, grpc_peer_host
from .errors import RateLimited
from .rate_limit import Limiter, RateLimits

RETRY_AFTER = "retry-after"  # trailing metadata of a rate-limited gRPC call: seconds, as HTTP's Retry-After
OPEN_REQUESTS = (health_pb2.HealthCheckRequest,)


@dataclass(frozen=True)
class Ticket:
    """An admitted call: charges what it generates to its caller (no limiter: nothing to charge)."""

    limiter: Limiter | None = None
    caller: str = ""

    def charge(self, message: Message) -> None:
        if self.limiter is not None:
            self.limiter.charge(self.caller, message)


FREE = Ticket()


class Gate:
    """One per deployment replica: the process's Access (from the environment) and the app's rate limits."""

    def __init__(self, access: Access, limits: RateLimits | None = None,
                 admin_requests: tuple[type[Message], ...] = ()):
        self.access = access
        self.limiter = Limiter(limits or RateLimits())
        self.admin_requests = admin_requests

    @classmethod
    def from_env(cls, limits: RateLimits | None = None, admin_requests: tuple[type[Message], ...] = ()) -> Gate:
        return cls(Access.from_env(), limits, admin_requests)

    def admit(self, authorization: str | None, host: str | None, *, admin: bool = False) -> Ticket:
        """Raises Unauthenticated, PermissionDenied (`admin` without an admin key) or RateLimited; else the
        ticket to charge the call's output to."""
        caller = (self.access.admin if admin else self.access.caller)(authorization, host)
        self.limiter.admit(caller)
        return Ticket(self.limiter, caller)

    def admit_grpc(self, request: Message, grpc_context: Any) -> Ticket:
        """`admit` for a call through the Serve gRPC proxy. A refusal for the rate limit also sets the trailing
        metadata `retry-after` (Ray Serve sends a stream's trailing metadata only with a message, so a refused
        stream carries the delay in its details alone)."""
        if grpc_context is None or isinstance(request, OPEN_REQUESTS):
            return FREE
        authorization = dict(grpc_context.invocation_metadata()).get("authorization")
        try:
            return self.admit(authorization, grpc_peer_host(grpc_context.peer()),
                              admin=isinstance(request, self.admin_requests))
        except RateLimited as exc:
            grpc_context.set_trailing_metadata([(RETRY_AFTER, str(exc.retry_after_s))])
            raise
