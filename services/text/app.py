"""The `text` application: genserve.v1.TextGeneration on Ray Serve, in front of the continuous-batching engine.

Each handler validates the request (pydantic), hands token ids to `AsyncLLMEngine` and turns its `Delta`s into
protobuf; streaming sends every delta as the engine produces it. Errors become statuses in services/common.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.deployment import Application

from genserve.services.common import health
from genserve.services.common.builder import build_app
from genserve.services.common.device import use_torch_threads
from genserve.services.common.errors import InvalidArgument
from genserve.services.common.gate import Gate
from genserve.services.common.metrics import ServiceMetrics
from genserve.services.common.rpc import streaming, unary, unknown_rpcs
from genserve.services.common.validation import parse
from genserve.services.text.engine.async_engine import AsyncLLMEngine
from genserve.services.text.engine.params import (
    Delta,
    SamplingParams,
)
from genserve.services.text.schema import KNOWN_ERRORS, PROMPT_BYTES_PER_TOKEN, ChatMessageIn, TextIn, TokenizeIn
from genserve.services.text.settings import TextArgs
from genserve.v1 import text_pb2

SERVICE = "genserve.v1.TextGeneration"


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
    known_errors = KNOWN_ERRORS

    def __init__(self, model_dir: str | None, settings: TextArgs | None = None):
        settings = settings or TextArgs()
        use_torch_threads(settings.torch_threads)
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
        self.metrics.engine_totals(**dataclasses.asdict(self.engine.engine.counters()))

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
                    logprobs=_logprob_messages(delta), prompt_tokens=len(prompt_ids) if delta.finish_reason else 0,
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
        self.metrics.engine_totals(**dataclasses.asdict(self.engine.engine.counters()))
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
