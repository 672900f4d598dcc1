"""The one mapping from Python exceptions to gRPC status codes, shared by the four apps.

A handler never builds a status by hand: it raises (or lets the model raise) and `to_status` decides.
- pydantic `ValidationError` and `InvalidArgument` -> INVALID_ARGUMENT, details naming the field;
- a service's own errors, passed in `known` with their code (e.g. the text engine's EngineOverloaded ->
  RESOURCE_EXHAUSTED, the diffusion pipeline's GenerationCancelled -> CANCELLED);
- `NotFound` -> NOT_FOUND; `Unimplemented` -> UNIMPLEMENTED; `TimeoutError` -> DEADLINE_EXCEEDED;
- `Unauthenticated` (no or a wrong API key, services/common/auth.py) -> UNAUTHENTICATED; `PermissionDenied` (a
  valid key that is not an admin key, on an admin call) -> PERMISSION_DENIED;
- `RateLimited` (a caller's bucket is empty, services/common/rate_limit.py) -> RESOURCE_EXHAUSTED;
- `Unavailable` (the stack is draining) -> UNAVAILABLE; `Cancelled` (the drain time ran out) -> CANCELLED, each with
  its message;
- `asyncio.CancelledError` (the client went away) -> CANCELLED;
- anything else -> INTERNAL with a short message and the request id: never a traceback or a file path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from pydantic import ValidationError

# The longest details string a client sees; a validation message is short, this only bounds pathological input.
MAX_DETAILS = 300


class InvalidArgument(ValueError):
    """A request field is wrong in a way pydantic cannot see (e.g. bytes that are not an image)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple:
        """Pickled with its two arguments, so it crosses a deployment handle (Ray pickles a replica's errors)."""
        return type(self), (self.field, self.message)


class NotFound(LookupError):
    """The request names something this server does not have (e.g. an unknown health service name)."""


class Unimplemented(LookupError):
    """The call reached an application that does not serve this RPC (wrong `application` metadata)."""


class Unauthenticated(PermissionError):
    """The call carries no valid API key (or comes from another host while no keys are configured)."""


class PermissionDenied(PermissionError):
    """The call's key is valid but may not make this call (an admin operation without an admin key)."""


class RateLimited(Exception):
    """The caller's token bucket for `what` (requests, tokens, images) is empty; it refills in `retry_after_s`."""

    def __init__(self, what: str, retry_after_s: int):
        super().__init__(f"rate limit of {what} reached for this caller; retry in {retry_after_s} s")
        self.what = what
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple:
        return type(self), (self.what, self.retry_after_s)


class Unavailable(RuntimeError):
    """The server takes no new calls now (it is draining); the client may retry, here later or elsewhere."""


class Cancelled(RuntimeError):
    """The server ended a call it had admitted (the drain time ran out), as opposed to the client going away."""


@dataclass(frozen=True)
class Status:
    code: grpc.StatusCode
    details: str


def field_path(loc: tuple) -> str:
    """pydantic's error location ("messages", 0, "role") as `messages[0].role`."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "request"


def _validation_details(exc: ValidationError) -> str:
    first = exc.errors(include_url=False, include_context=False, include_input=False)[0]
    message = str(first["msg"]).removeprefix("Value error, ")
    return f"{field_path(tuple(first['loc']))}: {message}"


def to_status(
    exc: BaseException,
    request_id: str,
    known: Mapping[type[BaseException], tuple[grpc.StatusCode, str | None]] | None = None,
) -> Status:
    """The status a client receives for `exc`.

    `known` maps a service's own exception types to (code, field): e.g. the text engine's PromptTooLong to
    (INVALID_ARGUMENT, "prompt"). Their message is shown after the field name.
    """
    for exc_type, (code, field) in (known or {}).items():
        if isinstance(exc, exc_type):
            message = str(exc) or exc_type.__name__
            return Status(code, _clip(f"{field}: {message}" if field else message))
    if isinstance(exc, ValidationError):
        return Status(grpc.StatusCode.INVALID_ARGUMENT, _clip(_validation_details(exc)))
    if isinstance(exc, InvalidArgument):
        return Status(grpc.StatusCode.INVALID_ARGUMENT, _clip(str(exc)))
    if isinstance(exc, Unimplemented):
        return Status(grpc.StatusCode.UNIMPLEMENTED, _clip(str(exc)))
    if isinstance(exc, NotFound):
        return Status(grpc.StatusCode.NOT_FOUND, _clip(str(exc)))
    if isinstance(exc, Unauthenticated):
        return Status(grpc.StatusCode.UNAUTHENTICATED, _clip(str(exc)))
    if isinstance(exc, PermissionDenied):
        return Status(grpc.StatusCode.PERMISSION_DENIED, _clip(str(exc)))
    if isinstance(exc, RateLimited):
        return Status(grpc.StatusCode.RESOURCE_EXHAUSTED, _clip(str(exc)))
    if isinstance(exc, Unavailable):
        return Status(grpc.StatusCode.UNAVAILABLE, _clip(str(exc)))
    if isinstance(exc, Cancelled):
        return Status(grpc.StatusCode.CANCELLED, _clip(str(exc)))
    if isinstance(exc, TimeoutError):
        return Status(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
    if isinstance(exc, asyncio.CancelledError):
        return Status(grpc.StatusCode.CANCELLED, "cancelled")
    return Status(grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})")


def _clip(details: str) -> str:
    return details if len(details) <= MAX_DETAILS else details[: MAX_DETAILS - 3] + "..."
