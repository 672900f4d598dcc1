"""Exceptions -> gRPC status: the right code, a details string naming the field, never a traceback."""

from __future__ import annotations

import asyncio

import grpc
from pydantic import BaseModel, Field

from genserve.services.common.errors import MAX_DETAILS, InvalidArgument, NotFound, field_path, to_status


class Inner(BaseModel):
    role: str = Field(pattern="^(user|system)$")


class Outer(BaseModel):
    messages: list[Inner]
    max_tokens: int = Field(ge=1)


def validation_error(data: dict) -> Exception:
    try:
        Outer.model_validate(data)
    except Exception as exc:  # pydantic.ValidationError
        return exc
    raise AssertionError("expected a validation error")


def test_validation_error_names_the_nested_field() -> None:
    status = to_status(validation_error({"messages": [{"role": "user"}, {"role": "x"}], "max_tokens": 3}), "r1")
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT
    assert status.details.startswith("messages[1].role: ")


def test_validation_error_on_a_scalar_field() -> None:
    status = to_status(validation_error({"messages": [], "max_tokens": 0}), "r1")
    assert status.details == "max_tokens: Input should be greater than or equal to 1"


def test_field_path_formats_indices_and_attributes() -> None:
    assert field_path(("latents", "shape")) == "latents.shape"
    assert field_path(("images", 3, "png")) == "images[3].png"
    assert field_path(()) == "request"


def test_codes_for_each_kind_of_failure() -> None:
    assert to_status(InvalidArgument("images[0].png", "is not a readable image"), "r").details == (
        "images[0].png: is not a readable image"
    )
    assert to_status(TimeoutError(), "r").code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert to_status(asyncio.CancelledError(), "r").code == grpc.StatusCode.CANCELLED
    assert to_status(NotFound("service: unknown"), "r").code == grpc.StatusCode.NOT_FOUND


def test_known_service_errors_map_with_their_field() -> None:
    class PromptTooLong(ValueError):
        pass

    known = {PromptTooLong: (grpc.StatusCode.INVALID_ARGUMENT, "prompt")}
    status = to_status(PromptTooLong("600 tokens exceed 512"), "r", known)
    assert (status.code, status.details) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt: 600 tokens exceed 512")


def test_unexpected_errors_are_internal_with_only_the_request_id() -> None:
    try:
        open("/definitely/not/here.py")
    except OSError as exc:
        status = to_status(exc, "abc123")
    assert status.code == grpc.StatusCode.INTERNAL
    assert status.details == "internal error (request id abc123)"


def test_details_are_clipped() -> None:
    status = to_status(InvalidArgument("prompt", "x" * 1000), "r")
    assert len(status.details) == MAX_DETAILS and status.details.endswith("...")
