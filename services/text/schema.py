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

from genserve.services.common.errors import InvalidArgument
from genserve.services.common.validation import Request
from genserve.services.text.engine.params import (
    MAX_LOGPROBS,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    AdapterCapacityExceeded,
    AdapterNotFound,
    EngineOverloaded,
    InvalidAdapter,
    InvalidGrammar,
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


MAX_TOOLS = 64
MAX_TOOL_CALLS = 16
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"
TOOL_CHOICES = ("", "auto", "none", "required", "function")
REASONING_EFFORTS = ("", "low", "medium", "high")
# A LoRA adapter's name: what TextRequest.adapter and OpenAI's `model` carry, and a Ray Serve multiplexed model id
# (gRPC metadata), so printable ASCII only, as Hugging Face repo ids ("org/name-lora") are.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
ADAPTER_NAME_RULE = "1..128 of A-Z a-z 0-9 . _ - : / @ +, starting with a letter or digit"
# The OpenAI API's ids of the text app's first model and of the image model (services/http/app.py).
TEXT_MODEL_ID, IMAGE_MODEL_ID = "text", "diffusion"
MAX_ADAPTER_PATH = 4096


def _adapter_name(name: str) -> str:
    if not ADAPTER_NAME.fullmatch(name):
        raise ValueError(f"must be {ADAPTER_NAME_RULE}")
    return name


def _name_or_empty(name: str) -> str:
    """A model's or adapter's name (the same rule: both are OpenAI `model` ids); "": the app's first model."""
    return _adapter_name(name) if name else name


class UnknownModel(LookupError):
    """A request names a base model that the text app does not serve (NOT_FOUND, naming it)."""


def _json_object(text: str, what: str) -> dict:
    """`text` parsed as a JSON object, nesting at most MAX_SCHEMA_DEPTH deep; ValueError says what is wrong."""
    try:
        document = json.loads(text, parse_constant=_not_a_number, parse_float=_finite)
    except RecursionError:
        raise ValueError(f"nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    except ValueError as exc:
        raise ValueError(f"is not valid JSON ({exc})") from None
    if not isinstance(document, dict):
        raise ValueError(f"must be {what}")
    if json_depth(document) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return document


class ToolCallIn(Request):
    id: str = Field(min_length=1, max_length=64)
    name: str = Field(pattern=TOOL_NAME)
    arguments: str = Field("{}", max_length=MAX_SCHEMA_CHARS)

    @field_validator("arguments")
    @classmethod
    def _arguments_are_an_object(cls, arguments: str) -> str:
        _json_object(arguments or "{}", "a JSON object")
        return arguments


class ChatMessageIn(Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[ToolCallIn] = Field(default_factory=list, max_length=MAX_TOOL_CALLS)
    tool_call_id: str = Field("", max_length=64)
    name: str = Field("", max_length=64)

    @field_validator("tool_calls")
    @classmethod
    def _calls_on_assistant_turns(cls, calls: list[ToolCallIn], info: ValidationInfo) -> list[ToolCallIn]:
        if calls and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool calls")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _tool_turns_answer_a_call(cls, call_id: str, info: ValidationInfo) -> str:
        if info.data.get("role") == "tool" and not call_id:
            raise ValueError("is required on a tool message (the id of the call it answers)")
        return call_id


class ToolIn(Request):
    name: str = Field(pattern=TOOL_NAME)
    description: str = Field("", max_length=MAX_SCHEMA_CHARS)
    parameters: str = Field("", max_length=MAX_SCHEMA_CHARS)

    @field_validator("parameters")
    @classmethod
    def _parameters_are_an_object_schema(cls, parameters: str) -> str:
        if parameters:
            schema = _json_object(parameters, "a JSON Schema object")
            if schema.get("type", "object") != "object":
                raise ValueError("must be a JSON Schema of type 'object' (a call's arguments are an object)")
        return parameters

    def parameters_schema(self) -> dict:
        return json.loads(self.parameters) if self.parameters else {"type": "object", "properties": {}}


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
    tools: list[ToolIn] = Field(default_factory=list, max_length=MAX_TOOLS)
    tool_choice: str = ""
    tool_name: str = ""
    # Off unless asked for: small models (SmolLM2-135M) allowed more calls repeat them until max_tokens.
    parallel_tool_calls: bool = False
    enable_thinking: bool | None = None
    reasoning_effort: str = ""
    adapter: str = ""  # a loaded LoRA adapter's name; "": the base model
    speculative: bool = True  # False: never drafted for (engine/speculative.py); the output is the same
    model: str = ""  # one of the app's further base models (serve config `models`); "": its first model

    _names = field_validator("adapter", "model")(_name_or_empty)

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
            _json_object(schema, "a JSON Schema object")
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

    @field_validator("tools")
    @classmethod
    def _tools_in_a_chat(cls, tools: list[ToolIn], info: ValidationInfo) -> list[ToolIn]:
        if tools and not info.data.get("messages"):
            raise ValueError("need messages (a chat), not a prompt")
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"names must differ ({next(n for n in names if names.count(n) > 1)!r} repeats)")
        if tools and (info.data.get("json_schema") or info.data.get("regex")):
            raise ValueError("cannot be combined with json_schema or regex (a reply follows one grammar)")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _known_choice(cls, choice: str, info: ValidationInfo) -> str:
        if choice not in TOOL_CHOICES:
            raise ValueError(f"must be one of {', '.join(repr(c) for c in TOOL_CHOICES[1:])}")
        if choice not in ("", "none") and not info.data.get("tools"):
            raise ValueError(f"{choice!r} needs tools")
        return choice

    @field_validator("tool_name")
    @classmethod
    def _names_a_tool(cls, name: str, info: ValidationInfo) -> str:
        named = info.data.get("tool_choice") == "function"
        if named and name not in {t.name for t in info.data.get("tools") or ()}:
            raise ValueError(f"{name!r} is not one of the request's tools")
        if name and not named:
            raise ValueError("is only read with tool_choice 'function'")
        return name

    @field_validator("reasoning_effort")
    @classmethod
    def _known_effort(cls, effort: str) -> str:
        if effort not in REASONING_EFFORTS:
            raise ValueError(f"must be one of {', '.join(repr(e) for e in REASONING_EFFORTS[1:])}")
        return effort

    @property
    def tool_mode(self) -> str:
        """The effective tool_choice: "none" without tools, "auto" when tools come without a choice."""
        if not self.tools:
            return "none"
        return self.tool_choice or "auto"

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: list[str]) -> list[str]:
        if any(not s or len(s) > MAX_STOP_CHARS for s in stop):
            raise ValueError(f"each stop string must have 1..{MAX_STOP_CHARS} characters")
        return stop

    def sampling_params(self, room: int, grammar: str = "") -> SamplingParams:
        """`room`: tokens left in the context after the prompt; an unset max_tokens takes min(default, room);
        `grammar`: the EBNF of the request's tool calls (services/text/tools/formats.py)."""
        max_tokens = self.max_tokens if self.max_tokens is not None else max(1, min(DEFAULT_MAX_TOKENS, room))
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=resolve_seed(self.seed), stop=tuple(self.stop),
            logprobs=self.logprobs, json_schema=self.json_schema, regex=self.regex, grammar=grammar,
            adapter=self.adapter, speculative=self.speculative,
        )


def check_conversation(messages: list[ChatMessageIn]) -> None:
    """Every tool message answers a call of an earlier assistant turn (InvalidArgument naming the message)."""
    calls: dict[str, str] = {}
    for i, message in enumerate(messages):
        calls.update((c.id, c.name) for c in message.tool_calls)
        if message.role == "tool" and message.tool_call_id not in calls:
            raise InvalidArgument(f"messages[{i}].tool_call_id",
                                  f"{message.tool_call_id!r} answers no tool call of an earlier assistant message")


class ModelInfoIn(Request):
    model: str = ""

    _model = field_validator("model")(_name_or_empty)


class TokenizeIn(ModelInfoIn):
    messages: list[ChatMessageIn] = Field(default_factory=list, max_length=MAX_MESSAGES)
    text: str = Field("", validate_default=True)

    @field_validator("text")
    @classmethod
    def _one_source(cls, text: str, info: ValidationInfo) -> str:
        return _prompt_or_messages(text, info, "text")


class UnloadAdapterIn(Request):
    name: str

    _name = field_validator("name")(_adapter_name)


class LoadAdapterIn(UnloadAdapterIn):
    path: str = Field(min_length=1, max_length=MAX_ADAPTER_PATH)

    @field_validator("path")
    @classmethod
    def _no_nul(cls, path: str) -> str:
        if "\0" in path:
            raise ValueError("must not contain NUL characters")
        return path


# The engine's errors that are the caller's doing or a full queue, as (status, the request field they name).
KNOWN_ERRORS: dict[type[Exception], tuple[grpc.StatusCode, str | None]] = {
    PromptTooLong: (grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    InvalidJsonSchema: (grpc.StatusCode.INVALID_ARGUMENT, "json_schema"),
    InvalidRegex: (grpc.StatusCode.INVALID_ARGUMENT, "regex"),
    InvalidGrammar: (grpc.StatusCode.INVALID_ARGUMENT, "tools"),
    EngineOverloaded: (grpc.StatusCode.RESOURCE_EXHAUSTED, None),
    NoChatTemplate: (grpc.StatusCode.FAILED_PRECONDITION, "messages"),
    # LoRA (engine/adapters.py): their messages name the adapter, the path or the tensor.
    UnknownModel: (grpc.StatusCode.NOT_FOUND, "model"),
    AdapterNotFound: (grpc.StatusCode.NOT_FOUND, "adapter"),
    AdapterCapacityExceeded: (grpc.StatusCode.RESOURCE_EXHAUSTED, "adapter"),
    InvalidAdapter: (grpc.StatusCode.INVALID_ARGUMENT, "path"),
}
