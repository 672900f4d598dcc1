"""The text service's wire schema: what a TextRequest or TokenizeRequest may hold once validated, with the one set
of limits that the gRPC handler (services/text/app.py) and the HTTP ingress (services/http) apply, and the engine
errors each maps to a status. Torch-free: the ingress imports it without the model code."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

import grpc
from pydantic import Field, ValidationInfo, field_validator

from genserve.services.common.validation import Request
from genserve.services.text.engine.params import (
    MAX_LOGPROBS,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    EngineOverloaded,
    InvalidJsonSchema,
    InvalidRegex,
    NoChatTemplate,
    PromptTooLong,
    SamplingParams,
)
from genserve.shared.seeds import MAX_SEED, resolve_seed

# Prompts are capped in tokens by the model's context (the engine's PromptTooLong); before tokenizing, their UTF-8
# size is capped at this many bytes per context token, against abuse (English runs at about 4 bytes per token).
PROMPT_BYTES_PER_TOKEN = 16
MAX_MESSAGES = 64
MAX_TOKENS = 1024
MAX_STOPS = 4
MAX_STOP_CHARS = 64
MAX_TOP_K = 1000
MAX_SCHEMA_CHARS = 16_384
MAX_REGEX_CHARS = 1_024
# Nested JSON containers in a json_schema: the grammar xgrammar builds grows with the square of the depth (a
# 256-deep schema compiles for seconds), and Python's json parser recurses; real schemas nest a few levels.
MAX_SCHEMA_DEPTH = 64
DEFAULT_MAX_TOKENS = 64
DEFAULT_TEMPERATURE = 1.0


class ChatMessageIn(Request):
    role: Literal["system", "user", "assistant"]
    content: str


def _not_a_number(constant: str) -> float:
    raise ValueError(f"{constant} is not a JSON number")


def _finite(number: str) -> float:
    value = float(number)
    if not math.isfinite(value):
        raise ValueError(f"number {number[:20]} is out of range")
    return value


def json_depth(document: Any) -> int:
    """How deeply JSON containers nest in `document` (a scalar: 0), without recursion."""
    deepest, todo = 0, [(document, 1)]
    while todo:
        value, depth = todo.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            todo += [(child, depth + 1) for child in children]
    return deepest


def _prompt_or_messages(prompt: str, info: ValidationInfo, what: str) -> str:
    has_messages = bool(info.data.get("messages"))
    if has_messages and prompt:
        raise ValueError(f"give either {what} or messages, not both")
    if not has_messages and not prompt:
        raise ValueError("must not be empty (or give messages)")
    return prompt


class TextIn(Request):
    """A TextRequest after validation; defaults are the documented ones (docs/protocol.md)."""

    messages: list[ChatMessageIn] = Field(default_factory=list, max_length=MAX_MESSAGES)
    prompt: str = Field("", validate_default=True)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOPS)
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=10, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    logprobs: int = Field(0, ge=0, le=MAX_LOGPROBS)
    json_schema: str = Field("", max_length=MAX_SCHEMA_CHARS)
    regex: str = Field("", max_length=MAX_REGEX_CHARS)

    @field_validator("temperature")
    @classmethod
    def _greedy_or_above_the_floor(cls, temperature: float) -> float:
        if 0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return temperature

    @field_validator("json_schema")
    @classmethod
    def _schema_is_a_json_object(cls, schema: str) -> str:
        if schema:
            try:
                document = json.loads(schema, parse_constant=_not_a_number, parse_float=_finite)
            except RecursionError:
                raise ValueError(f"nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
            except ValueError as exc:
                raise ValueError(f"is not valid JSON ({exc})") from None
            if not isinstance(document, dict):
                raise ValueError("must be a JSON Schema object")
            if json_depth(document) > MAX_SCHEMA_DEPTH:
                raise ValueError(f"nests deeper than {MAX_SCHEMA_DEPTH} levels")
        return schema

    @field_validator("regex")
    @classmethod
    def _one_grammar_and_a_valid_pattern(cls, regex: str, info: ValidationInfo) -> str:
        if regex and info.data.get("json_schema"):
            raise ValueError("give at most one of json_schema and regex")
        if regex:
            try:
                re.compile(regex)
            except (re.error, OverflowError) as exc:  # OverflowError: a repeat count beyond 2**32 - 2
                raise ValueError(f"is not a valid regular expression ({exc})") from None
            except RecursionError:
                raise ValueError("nests too deeply") from None
        return regex

    @field_validator("prompt")
    @classmethod
    def _one_source(cls, prompt: str, info: ValidationInfo) -> str:
        return _prompt_or_messages(prompt, info, "prompt")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: list[str]) -> list[str]:
        if any(not s or len(s) > MAX_STOP_CHARS for s in stop):
            raise ValueError(f"each stop string must have 1..{MAX_STOP_CHARS} characters")
        return stop

    def sampling_params(self, room: int) -> SamplingParams:
        """`room`: tokens left in the context after the prompt; an unset max_tokens takes min(default, room)."""
        max_tokens = self.max_tokens if self.max_tokens is not None else max(1, min(DEFAULT_MAX_TOKENS, room))
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=resolve_seed(self.seed), stop=tuple(self.stop),
            logprobs=self.logprobs, json_schema=self.json_schema, regex=self.regex,
        )


class TokenizeIn(Request):
    messages: list[ChatMessageIn] = Field(default_factory=list, max_length=MAX_MESSAGES)
    text: str = Field("", validate_default=True)

    @field_validator("text")
    @classmethod
    def _one_source(cls, text: str, info: ValidationInfo) -> str:
        return _prompt_or_messages(text, info, "text")


# The engine's errors that are the caller's doing or a full queue, as (status, the request field they name).
KNOWN_ERRORS: dict[type[Exception], tuple[grpc.StatusCode, str | None]] = {
    PromptTooLong: (grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    InvalidJsonSchema: (grpc.StatusCode.INVALID_ARGUMENT, "json_schema"),
    InvalidRegex: (grpc.StatusCode.INVALID_ARGUMENT, "regex"),
    EngineOverloaded: (grpc.StatusCode.RESOURCE_EXHAUSTED, None),
    NoChatTemplate: (grpc.StatusCode.FAILED_PRECONDITION, "messages"),
}
