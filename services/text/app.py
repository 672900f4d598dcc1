"""The `text` application: genserve.v1.TextGeneration on Ray Serve, in front of the continuous-batching engine.

Each handler validates the request (pydantic), hands token ids to `AsyncLLMEngine` and turns its `Delta`s into
protobuf; streaming sends every delta as the engine produces it. Errors become statuses in services/common.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import grpc
import jinja2
from genserve.v1 import text_pb2
from grpc_health.v1 import health_pb2
from pydantic import Field, field_validator
from pydantic_core.core_schema import ValidationInfo
from ray import serve
from ray.serve.deployment import Application

from services.common import health
from services.common.builder import build_app
from services.common.errors import InvalidArgument
from services.common.gate import Gate
from services.common.metrics import ServiceMetrics
from services.common.rpc import streaming, unary, unknown_rpcs
from services.common.validation import MAX_SEED, Request, parse, resolve_seed
from services.text.engine import AsyncLLMEngine, Delta, EngineOverloaded, PromptTooLong, SamplingParams
from services.text.engine.params import MIN_REPETITION_PENALTY, MIN_TEMPERATURE, InvalidJsonSchema, InvalidRegex
from services.text.settings import TextArgs
from services.text.tokenizer import NoChatTemplate

SERVICE = "genserve.v1.TextGeneration"
# Prompts are capped in tokens by the model's context (the engine's PromptTooLong); before tokenizing, their UTF-8
# size is capped at this many bytes per context token, against abuse (English runs at about 4 bytes per token).
PROMPT_BYTES_PER_TOKEN = 16
MAX_MESSAGES = 64
MAX_TOKENS = 1024
MAX_STOPS = 4
MAX_STOP_CHARS = 64
MAX_TOP_K = 1000
MAX_LOGPROBS = 5
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


def _logprob_messages(delta: Delta) -> list[text_pb2.TokenLogprob]:
    return [
        text_pb2.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob,
            top=[text_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
        )
        for lp in delta.logprobs
    ]


@serve.deployment(name="TextGeneration")
class TextGeneration:
    __getattr__ = unknown_rpcs
    known_errors = {
        PromptTooLong: (grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        InvalidJsonSchema: (grpc.StatusCode.INVALID_ARGUMENT, "json_schema"),
        InvalidRegex: (grpc.StatusCode.INVALID_ARGUMENT, "regex"),
        EngineOverloaded: (grpc.StatusCode.RESOURCE_EXHAUSTED, None),
        NoChatTemplate: (grpc.StatusCode.FAILED_PRECONDITION, "messages"),
    }

    def __init__(self, model_dir: str | None, settings: TextArgs | None = None):
        settings = settings or TextArgs()
        self.metrics = ServiceMetrics("text")
        self.gate = Gate.from_env(settings.rate_limits)
        self.engine = AsyncLLMEngine.from_dir(model_dir, dtype=settings.dtype, config=settings.engine_config(),
                                              stall_s=settings.stall_seconds)
        self.metrics.cpu_kernels(self.engine.engine.runner.cpu_kernels)
        self.max_prompt_bytes = PROMPT_BYTES_PER_TOKEN * self.engine.max_context
        # The grammar engine loads in seconds: in the background, so the first structured request need not wait.
        threading.Thread(target=self.engine.engine.grammars.warm_up, name="genserve-grammar-warm-up",
                         daemon=True).start()

    def _prompt_ids(self, prompt: str, messages: list[ChatMessageIn], field: str = "prompt") -> list[int]:
        size = len(prompt.encode()) + sum(len(m.content.encode()) for m in messages)
        if size > self.max_prompt_bytes:
            raise InvalidArgument("messages" if messages else field,
                                  f"{size} bytes is more than this model's {self.engine.max_context}-token context "
                                  f"can hold (at most {self.max_prompt_bytes} bytes)")
        tokenizer = self.engine.tokenizer
        if not messages:
            return tokenizer.encode(prompt)
        try:
            text = tokenizer.apply_chat_template([m.model_dump() for m in messages])
        except (ValueError, jinja2.TemplateError) as exc:  # the template refused the conversation
            raise InvalidArgument("messages", str(exc)) from exc
        return tokenizer.encode(text, add_special_tokens=False)

    def _prepare(self, request: text_pb2.TextRequest) -> tuple[list[int], SamplingParams]:
        req = parse(TextIn, request)
        prompt_ids = self._prompt_ids(req.prompt, req.messages)
        if not prompt_ids:
            raise InvalidArgument("prompt", "encodes to no tokens")
        return prompt_ids, req.sampling_params(room=self.engine.max_context - len(prompt_ids))

    async def _deltas(self, prompt_ids: list[int], params: SamplingParams, method: str) -> AsyncIterator[Delta]:
        """The engine's deltas as they come; closing this generator aborts the request in the engine."""
        start, first = time.perf_counter(), True
        live = method == "GenerateStream"  # a unary reply is read whole: its tokens may come in lookahead bursts
        async with contextlib.aclosing(self.engine.stream(prompt_ids, params, uuid.uuid4().hex,
                                                          interactive=live)) as stream:
            async for delta in stream:
                if first and delta.token_ids:
                    self.metrics.first_token(method, time.perf_counter() - start)
                    first = False
                self.metrics.tokens(len(delta.token_ids))
                yield delta
        self.metrics.kv_free_blocks(self.engine.kv_blocks_free)
        self.metrics.prefix_cache(*self.engine.engine.prefix_cache_stats())

    @unary(text_pb2.TextRequest, text_pb2.TextResponse)
    async def Generate(self, request: text_pb2.TextRequest) -> text_pb2.TextResponse:
        prompt_ids, params = self._prepare(request)
        reply = text_pb2.TextResponse(prompt_tokens=len(prompt_ids), seed=params.seed)
        texts: list[str] = []
        async with contextlib.aclosing(self._deltas(prompt_ids, params, "Generate")) as deltas:
            async for delta in deltas:
                texts.append(delta.text)
                reply.token_ids.extend(delta.token_ids)
                reply.logprobs.extend(_logprob_messages(delta))
                reply.finish_reason = delta.finish_reason or ""
        reply.text = "".join(texts)
        return reply

    @streaming(text_pb2.TextRequest)
    async def GenerateStream(self, request: text_pb2.TextRequest) -> AsyncIterator[text_pb2.TextChunk]:
        prompt_ids, params = self._prepare(request)
        async with contextlib.aclosing(self._deltas(prompt_ids, params, "GenerateStream")) as deltas:
            async for delta in deltas:
                yield text_pb2.TextChunk(
                    text=delta.text, token_ids=delta.token_ids, finish_reason=delta.finish_reason or "",
                    logprobs=_logprob_messages(delta),
                )

    @unary(text_pb2.TokenizeRequest, text_pb2.TokenizeResponse)
    async def Tokenize(self, request: text_pb2.TokenizeRequest) -> text_pb2.TokenizeResponse:
        req = parse(TokenizeIn, request)
        ids = self._prompt_ids(req.text, req.messages, "text")
        decode = self.engine.tokenizer.decode
        return text_pb2.TokenizeResponse(token_ids=ids, tokens=[decode([i], skip_special_tokens=False) for i in ids])

    @unary(text_pb2.ModelInfoRequest, text_pb2.ModelInfo)
    async def GetModelInfo(self, request: text_pb2.ModelInfoRequest) -> text_pb2.ModelInfo:
        info = self.engine.info()
        self.metrics.kv_free_blocks(info["kv_blocks_free"])
        self.metrics.prefix_cache(*self.engine.engine.prefix_cache_stats())
        fields = text_pb2.ModelInfo.DESCRIPTOR.fields_by_name
        return text_pb2.ModelInfo(**{k: v for k, v in info.items() if k in fields})

    def token_texts(self, token_ids: list[int]) -> dict[int, str]:
        """Each token's text decoded on its own, as Tokenize's `tokens` (a deployment-handle method for the HTTP
        API's logprobs, not an RPC)."""
        decode = self.engine.tokenizer.decode
        return {i: decode([i], skip_special_tokens=False) for i in token_ids}

    def check_health(self) -> None:
        """Ray Serve's replica health check: a failed or stalled engine loop gets the replica replaced."""
        if self.engine.error is not None:
            raise RuntimeError(f"text engine failed: {type(self.engine.error).__name__}")
        if self.engine.stalled:
            raise RuntimeError(f"text engine stalled: no step finished for {self.engine.progress.stall_s:.0f} s "
                               "while requests wait")

    @unary(health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse)
    async def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        """NOT_SERVING once the engine's step loop has failed or stalled (requests would fail or wait forever)."""
        return health.check(request, SERVICE, serving=self.engine.error is None and not self.engine.stalled)


def build(args: dict[str, Any] | None = None) -> Application:
    return build_app("text", TextGeneration, args, TextArgs)
