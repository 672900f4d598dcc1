"""Errors as OpenAI's error object: `{"error": {"message", "type", "param", "code"}}` with the fitting HTTP status.

The status comes from the one mapping every gRPC handler uses (services/common/errors.py): INVALID_ARGUMENT is 400,
NOT_FOUND 404, RESOURCE_EXHAUSTED 429 (with Retry-After), UNAUTHENTICATED 401, PERMISSION_DENIED 403 (an admin
route without an admin key), UNAVAILABLE 503 (draining),
INTERNAL 500 with only a request id. `param` names the
field as the client spelled it (`fields` maps the gRPC schema's names, e.g. TextIn's `logprobs`, onto the body's).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import grpc
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError

from genserve.services.common.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RateLimited,
    Unauthenticated,
    field_path,
    to_status,
)

RETRY_AFTER_S = 1
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
              404: "invalid_request_error",
              413: "invalid_request_error", 429: "rate_limit_error"}
ERROR_CODE = {401: "invalid_api_key", 403: "permission_denied", 404: "model_not_found", 413: "request_too_large",
              429: "overloaded", 500: "internal_error"}


class ModelNotFound(NotFound):
    def __init__(self, model: str | None, endpoint: str):
        super().__init__(f"the model {model!r} does not exist or does not serve {endpoint}")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": code or ERROR_CODE.get(status, "invalid_value" if status == 400 else None)}}


def unwrap(exc: BaseException) -> BaseException:
    """The replica's own exception behind a deployment handle's RayTaskError (whose text is a traceback)."""
    while isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    return exc


def _internal_field(exc: BaseException, known: Mapping[type[BaseException], tuple[Any, str | None]]) -> str | None:
    for exc_type, (_, field) in known.items():
        if isinstance(exc, exc_type):
            return field
    if isinstance(exc, ValidationError):
        return field_path(tuple(exc.errors(include_url=False)[0]["loc"]))
    if isinstance(exc, InvalidArgument):
        return exc.field
    return None


def rename(path: str | None, fields: Mapping[str, str]) -> str | None:
    """`messages[0].content` stays; `logprobs` becomes `top_logprobs` when `fields` says so; a key with "[]" maps
    a prefix at any indices (`tools[].` -> `tools[].function.` turns `tools[2].parameters` into
    `tools[2].function.parameters`)."""
    if path is None:
        return None
    for internal, public in fields.items():
        if "[]" in internal:
            found = re.match(re.escape(internal).replace(r"\[\]", r"\[(\d+)\]"), path)
            if found:
                parts = public.split("[]")
                named = "".join(part + f"[{index}]" for part, index in zip(parts, found.groups(), strict=False))
                return named + parts[-1] + path[found.end():]
    head, sep, rest = path.partition(".")
    bracket = head.find("[")
    if bracket > 0:
        head, rest, sep = head[:bracket], head[bracket:] + sep + rest, ""
    return fields.get(head, head) + sep + rest


def describe(exc: BaseException, request_id: str, fields: Mapping[str, str] | None = None,
             known: Mapping[type[BaseException], tuple[grpc.StatusCode, str | None]] | None = None
             ) -> tuple[int, dict[str, Any]]:
    """(HTTP status, error object) for `exc` raised while serving a request, here or in a replica behind a
    handle; `known` is the called deployment's `known_errors`."""
    exc = unwrap(exc)
    if isinstance(exc, BackPressureError):  # Serve's queue for the deployment is full
        return 429, error_body(429, "the service is at capacity, retry later")
    known = known or {}
    status = to_status(exc, request_id, known)
    http = HTTP_STATUS.get(status.code, 500)
    if http == 500:
        return 500, error_body(500, status.details)
    internal = _internal_field(exc, known)
    param = rename(internal, fields or {})
    message = status.details
    if internal and param and message.startswith(internal):
        message = param + message[len(internal):]
    # OpenAI's model_not_found names the model in its message and leaves param null.
    return http, error_body(http, message, None if (http, param) == (404, "model") else param)


def to_error(exc: BaseException, request_id: str, fields: Mapping[str, str] | None = None,
             known: Mapping[type[BaseException], tuple[grpc.StatusCode, str | None]] | None = None) -> JSONResponse:
    status, body = describe(exc, request_id, fields, known)
    return _response(status, body, request_id)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   request_id: str | None = None) -> JSONResponse:
    return _response(status, error_body(status, message, param, code), request_id)


def refusal(exc: Unauthenticated | PermissionDenied | RateLimited) -> JSONResponse:
    """401 for a call without a valid key, 403 for an admin route without an admin key, 429 with the caller's own
    Retry-After for a rate limit; the same message as over gRPC."""
    if isinstance(exc, RateLimited):
        return _response(429, error_body(429, str(exc), code="rate_limit_exceeded"), None, exc.retry_after_s)
    status = 403 if isinstance(exc, PermissionDenied) else 401
    return _response(status, error_body(status, str(exc)), None)


def _response(status: int, body: dict[str, Any], request_id: str | None,
              retry_after_s: int = RETRY_AFTER_S) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if status == 429 else {}
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(body, status_code=status, headers=headers)
