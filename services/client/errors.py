"""gRPC errors as Python exceptions: every failed call raises a GenserveError subclass named after its status."""

from __future__ import annotations

import grpc

RETRY_AFTER = "retry-after"


class GenserveError(Exception):
    """A call failed; `code` is the gRPC status, `details` the server's message (it names the bad field).
    `retry_after_s`: the server's `retry-after` trailing metadata (a rate-limited unary call), else None."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None = None):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.retry_after_s = retry_after_s


class InvalidArgument(GenserveError):
    """The request was refused; `details` names the field."""


class ResourceExhausted(GenserveError):
    """The service is over capacity, or the caller over its rate limit; retry later (after `retry_after_s`)."""


class Unauthenticated(GenserveError):
    """No or a wrong API key (--api-key / $GENSERVE_API_KEY), or a call from another host to a server without keys."""


class PermissionDenied(GenserveError):
    """The key is valid but not for this call: loading or unloading adapters needs an admin key."""


class DeadlineExceeded(GenserveError):
    """The call's deadline passed first."""


class Cancelled(GenserveError):
    """The call was cancelled."""


class NotFound(GenserveError):
    """Unknown application or service name."""


class Unavailable(GenserveError):
    """Nothing answers at the address (is `make serve` running?)."""


class Internal(GenserveError):
    """The server failed; `details` carries a request id to find it in the server's logs."""


_BY_CODE: dict[grpc.StatusCode, type[GenserveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.INTERNAL: Internal,
}


def _retry_after(error: grpc.RpcError) -> float | None:
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    value = dict(trailing or ()).get(RETRY_AFTER)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def from_rpc_error(error: grpc.RpcError) -> GenserveError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    return _BY_CODE.get(code, GenserveError)(code, details, _retry_after(error))
