"""Request validation: protobuf message -> plain dict -> a pydantic model that names the failing field.

Unset proto3 `optional` fields are left out of the dict, so the pydantic model's default (the documented one)
applies; a field that is set, even to zero, is validated as given (temperature 0 means greedy).
"""

from __future__ import annotations

from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from pydantic import BaseModel, ConfigDict

M = TypeVar("M", bound=BaseModel)


class Request(BaseModel):
    """Base of every request schema: frozen, and unknown keys are errors (they would be a proto/schema drift)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def message_to_dict(message: Message) -> dict[str, Any]:
    """The fields of `message`, recursively; fields with presence that are unset are omitted."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        repeated = field.is_repeated
        if not repeated and field.has_presence and not message.HasField(field.name):
            continue
        value = getattr(message, field.name)
        is_message = field.type == FieldDescriptor.TYPE_MESSAGE
        if repeated:
            out[field.name] = [message_to_dict(v) if is_message else v for v in value]
        else:
            out[field.name] = message_to_dict(value) if is_message else value
    return out


def parse(schema: type[M], message: Message) -> M:
    """Validate `message` against `schema`; raises pydantic.ValidationError naming the field."""
    return schema.model_validate(message_to_dict(message))


