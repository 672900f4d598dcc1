"""Proto -> dict -> pydantic: unset optionals take the schema default, set ones (even 0) are validated."""

from __future__ import annotations

import pytest
from pydantic import Field, ValidationError

from genserve.services.common.validation import Request, message_to_dict, parse
from genserve.shared.seeds import resolve_seed
from genserve.v1 import common_pb2, text_pb2, vae_pb2


class Sampling(Request):
    prompt: str
    messages: list[dict] = []
    temperature: float = Field(1.0, ge=0)
    stop: list[str] = []
    json_schema: str = ""
    regex: str = ""
    tools: list[dict] = []
    tool_choice: str = ""
    tool_name: str = ""
    reasoning_effort: str = ""


def test_unset_optional_fields_are_omitted() -> None:
    # Plain proto3 scalars (no `optional`) have no presence: they are always there, at their zero value.
    assert message_to_dict(text_pb2.TextRequest(prompt="hi")) == {
        "prompt": "hi", "messages": [], "stop": [], "json_schema": "", "regex": "", "tools": [], "tool_choice": "",
        "tool_name": "", "reasoning_effort": ""}


def test_an_optional_set_to_zero_is_kept() -> None:
    data = message_to_dict(text_pb2.TextRequest(prompt="hi", temperature=0.0, top_k=0))
    assert data["temperature"] == 0.0 and data["top_k"] == 0


def test_nested_messages_become_dicts() -> None:
    request = vae_pb2.DecodeRequest(latents=common_pb2.Tensor(shape=[1, 2], dtype="float16", data=b"\1\2\3\4"))
    assert message_to_dict(request) == {"latents": {"shape": [1, 2], "dtype": "float16", "data": b"\1\2\3\4"}}
    assert message_to_dict(vae_pb2.DecodeRequest()) == {}


def test_parse_applies_defaults_and_rejects_unknown_keys() -> None:
    parsed = parse(Sampling, text_pb2.TextRequest(prompt="hi", stop=["x"]))
    assert parsed.temperature == 1.0 and parsed.stop == ["x"]
    assert parse(Sampling, text_pb2.TextRequest(prompt="hi", temperature=0.0)).temperature == 0.0
    with pytest.raises(ValidationError, match="max_tokens"):
        parse(Sampling, text_pb2.TextRequest(prompt="hi", max_tokens=3))


def test_resolve_seed_keeps_a_given_seed_and_draws_otherwise() -> None:
    assert resolve_seed(42) == 42
    drawn = {resolve_seed(None) for _ in range(8)}
    assert len(drawn) > 1 and all(0 <= s < 2**31 for s in drawn)
