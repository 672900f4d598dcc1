"""The handler wrapper every RPC method goes through: metrics, request id, and errors -> gRPC status.

A deployment method named after its RPC is decorated with `unary(RequestType, ResponseType)` or
`streaming(RequestType)`. The wrapped method only validates, calls the model and builds the reply; whatever it
raises is turned into a status by services/common/errors.py and set on Ray Serve's `grpc_context`, so no
traceback ever reaches the client.
The deployment provides `self.metrics` (a ServiceMetrics), `self.gate` (a genserve.services.common.gate.Gate: API keys,
the peer rule and rate limits, checked first) and may provide `known_errors` (see errors.to_status).
While the stack drains (services/common/drain.py), `_admit` refuses new calls from clients with UNAVAILABLE and
`_in_flight` counts the calls that run, so that the drain can wait for them and, past its deadline, cut them short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from genserve.v1 import common_pb2

from . import drain
from .errors import Status, Unavailable, Unimplemented, to_status
from .ray_adapter import serve_request_id

logger = logging.getLogger("ray.serve")
# Operator probes: answered while draining (health says NOT_SERVING) and never counted as work in flight.
PROBES = (health_pb2.HealthCheckRequest, common_pb2.StatusRequest)


class StatusSet(Exception):
    """Ends a stream whose status is already set on the grpc_context."""


def request_id_of(grpc_context: Any) -> str:
    """The client's `request_id` metadata, else the id Ray Serve gave the request (it prefixes the replica's log
    lines and comes back in the trailing metadata), else a fresh one."""
    rid = grpc_context.request_id() if grpc_context is not None else None
    return rid or serve_request_id() or uuid.uuid4().hex


def _status(owner: Any, method: str, exc: BaseException, request_id: str) -> Status:
    """The status for `exc`; unexpected errors are logged here with their traceback, for the operator only."""
    status = to_status(exc, request_id, getattr(owner, "known_errors", None))
    if status.code == grpc.StatusCode.INTERNAL:
        logger.exception("%s.%s failed (request id %s)", owner.metrics.service, method, request_id)
    return status


def _check_request_type(name: str, owner: Any, request: Any, expected: type[Message]) -> None:
    """The proxy deserialises with the *called* RPC's types and routes by metadata only, so a request for another
    service's method of the same name (Diffusion/Generate sent with `application: text`) lands here."""
    if not isinstance(request, expected):
        got = request.DESCRIPTOR.full_name if isinstance(request, Message) else type(request).__name__
        raise Unimplemented(
            f"{name}: application '{owner.metrics.service}' takes {expected.DESCRIPTOR.full_name}, not {got}; "
            "check the `application` metadata"
        )


def _admit(request: Message, grpc_context: Any) -> None:
    """While draining, a client's new call gets UNAVAILABLE. Deployment-handle calls (no grpc_context) are work of a
    call already admitted (diffusion -> vae, the HTTP API -> text) and pass, as do health probes."""
    if grpc_context is not None and not isinstance(request, PROBES) and drain.watch().current().draining:
        raise Unavailable(drain.DRAINING_MESSAGE)


def _in_flight(request: Message) -> contextlib.AbstractContextManager:
    """The call counted as in flight for the drain, which ends it with CANCELLED past the drain's deadline."""
    return contextlib.nullcontext() if isinstance(request, PROBES) else drain.watch().call()


def unknown_rpcs(self: Any, name: str) -> Callable:
    """`__getattr__` for deployments: an RPC the application does not have (wrong `application` metadata) answers
    UNIMPLEMENTED instead of Ray Serve's INTERNAL with a traceback. Only RPC-style names (capitalised) are
    answered, so Ray's own hooks (check_health, reconfigure, ...) stay absent."""
    if not name[:1].isupper():
        raise AttributeError(name)

    async def handler(request: Message, grpc_context: Any = None) -> None:
        status = to_status(Unimplemented(f"{name}: application '{self.metrics.service}' has no such method; "
                                         "check the `application` metadata"), request_id_of(grpc_context))
        if grpc_context is None:
            raise Unimplemented(status.details)
        grpc_context.set_code(status.code)
        grpc_context.set_details(status.details)
        raise StatusSet(status.code.name)

    handler.__name__ = name
    return handler


def unary(request_type: type[Message], response_type: type[Message]) -> Callable:
    """Decorate `async def Rpc(self, request) -> response`. On error the client gets the status, not a reply."""

    def wrap(fn: Callable[[Any, Message], Awaitable[Message]]) -> Callable:
        async def handler(self: Any, request: Message, grpc_context: Any = None) -> Message:
            start, code, request_id = time.perf_counter(), "OK", request_id_of(grpc_context)
            self.metrics.request_started()
            try:
                ticket = self.gate.admit_grpc(request, grpc_context)
                _check_request_type(fn.__name__, self, request, request_type)
                _admit(request, grpc_context)
                with _in_flight(request):
                    reply = await fn(self, request)
                ticket.charge(reply)
                return reply
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception as exc:
                status = _status(self, fn.__name__, exc, request_id)
                code = status.code.name
                if grpc_context is None:  # a deployment-handle call: the caller gets the exception
                    raise
                grpc_context.set_code(status.code)
                grpc_context.set_details(status.details)
                return response_type()
            finally:
                self.metrics.request_finished(fn.__name__, code, time.perf_counter() - start)

        handler.__name__ = handler.__qualname__ = fn.__name__
        handler.__doc__ = fn.__doc__
        return handler

    return wrap


def streaming(request_type: type[Message]) -> Callable:
    """Decorate `async def Rpc(self, request)` async generators; an error ends the stream with its status."""

    def wrap(fn: Callable[[Any, Message], AsyncIterator[Message]]) -> Callable:
        async def handler(self: Any, request: Message, grpc_context: Any = None) -> AsyncIterator[Message]:
            start, code, request_id = time.perf_counter(), "OK", request_id_of(grpc_context)
            self.metrics.request_started()
            try:
                ticket = self.gate.admit_grpc(request, grpc_context)
                _check_request_type(fn.__name__, self, request, request_type)
                _admit(request, grpc_context)
                with _in_flight(request):
                    async with contextlib.aclosing(fn(self, request)) as messages:
                        async for message in messages:
                            ticket.charge(message)
                            yield message
            except (asyncio.CancelledError, GeneratorExit):
                code = "CANCELLED"
                raise
            except Exception as exc:
                status = _status(self, fn.__name__, exc, request_id)
                code = status.code.name
                if grpc_context is None:
                    raise
                grpc_context.set_code(status.code)
                grpc_context.set_details(status.details)
                # A stream hands its context to the proxy only with a message; raising after set_code makes Ray
                # Serve carry our code and details (gRPCStatusError) instead of INTERNAL and a traceback.
                raise StatusSet(code) from None
            finally:
                self.metrics.request_finished(fn.__name__, code, time.perf_counter() - start)

        handler.__name__ = handler.__qualname__ = fn.__name__
        handler.__doc__ = fn.__doc__
        return handler

    return wrap
