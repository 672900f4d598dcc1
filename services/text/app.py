"""The `text` application: genserve.v1.TextGeneration on Ray Serve, in front of the continuous-batching engine.

Each handler validates the request (pydantic), hands token ids to `AsyncLLMEngine` and turns its `Delta`s into
protobuf; streaming sends every delta as the engine produces it. Errors become statuses in services/common.

Several base models (serve config `models`): each replica holds one engine per model; a request's `model` picks
one, and unset picks the first (`model_dir`), the only one that takes LoRA adapters.

LoRA adapters (serve config `lora`): LoadAdapter / UnloadAdapter need an admin key when keys are set
(services/common/gate.py). With `lora`, the app also runs AdapterNames (services/text/adapter_names.py), the one
record of the adapters' names that every replica follows before a request uses an adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from genserve.services.common import health
from genserve.services.common.builder import build_app
from genserve.services.common.device import use_torch_threads
from genserve.services.common.errors import InvalidArgument
from genserve.services.common.gate import Gate
from genserve.services.common.gc_freeze import freeze_loaded_objects
from genserve.services.common.metrics import ServiceMetrics
from genserve.services.common.rpc import streaming, unary, unknown_rpcs
from genserve.services.common.validation import parse
from genserve.services.text.adapter_names import AdapterNames
from genserve.services.text.engine.async_engine import AsyncLLMEngine
from genserve.services.text.engine.params import (
    AdapterNotFound,
    Delta,
    InvalidAdapter,
    SamplingParams,
)
from genserve.services.text.schema import (
    KNOWN_ERRORS,
    PROMPT_BYTES_PER_TOKEN,
    ChatMessageIn,
    LoadAdapterIn,
    ModelInfoIn,
    TextIn,
    TokenizeIn,
    UnknownModel,
    UnloadAdapterIn,
    check_conversation,
)
from genserve.services.text.settings import TextArgs
from genserve.services.text.tools.formats import (
    ToolSpec,
    call_grammar,
    check_schema,
    generic_messages,
    opens_thinking,
    template_message,
)
from genserve.services.text.tools.parsers import StreamParser
from genserve.services.text.tools.parsers import parse as parse_reply
from genserve.v1 import text_pb2

SERVICE = "genserve.v1.TextGeneration"
ADMIN_REQUESTS = (text_pb2.LoadAdapterRequest, text_pb2.UnloadAdapterRequest)
# The engine's finish reasons after which a reply that made calls ends with "tool_calls", as OpenAI's do.
CALL_ENDINGS = ("eos", "stop")


@dataclass(frozen=True)
class Prepared:
    """A validated request: its engine, prompt, sampling, and how to read its reply (`tool_format` None: no calls)."""

    model: str
    engine: AsyncLLMEngine
    prompt_ids: list[int]
    params: SamplingParams
    tool_format: str | None
    reasoning: bool
    thinking: bool

    def new_call_id(self) -> str:
        # Mistral's templates refuse any call id but 9 letters and digits.
        return uuid.uuid4().hex[:9] if self.tool_format == "mistral" else f"call_{uuid.uuid4().hex[:24]}"


def _finish(reason: str, called: bool) -> str:
    return "tool_calls" if called and reason in CALL_ENDINGS else reason


def _render(tokenizer: Any, messages: list[ChatMessageIn], req: TextIn | None) -> str:
    """The chat prompt: the template's own rendering of tools and tool turns, or the generic format's."""
    dumped = [m.model_dump() for m in messages]
    kwargs: dict[str, Any] = {}
    if req is not None and req.enable_thinking is not None:
        kwargs["enable_thinking"] = req.enable_thinking
    if req is not None and req.reasoning_effort:
        kwargs["reasoning_effort"] = req.reasoning_effort
    tools = [ToolSpec(t.name, t.description, t.parameters_schema()) for t in (req.tools if req else ())]
    mode = req.tool_mode if req is not None else "none"
    if tokenizer.tool_format == "generic":
        return tokenizer.apply_chat_template(generic_messages(dumped, tools, mode), **kwargs)
    return tokenizer.apply_chat_template([template_message(m) for m in dumped],
                                         tools=[t.schema() for t in tools] or None, **kwargs)


def _tool_grammar(fmt: str, req: TextIn) -> str:
    """The EBNF the reply follows under the request's tool_choice; a schema xgrammar cannot compile is named."""
    if req.tool_mode == "none":
        return ""
    for i, tool in enumerate(req.tools):
        try:
            check_schema(tool.parameters_schema())
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidArgument(f"tools[{i}].parameters", f"the grammar engine cannot compile it: {exc}") from None
    callable_tools = [ToolSpec(t.name, t.description, t.parameters_schema()) for t in req.tools
                      if req.tool_mode != "function" or t.name == req.tool_name]
    try:
        return call_grammar(fmt, callable_tools, req.tool_mode, req.parallel_tool_calls)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidArgument("tools", f"the grammar engine cannot compile the calls: {exc}") from None


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

    def __init__(self, model_dir: str | None, settings: TextArgs | None = None,
                 adapter_names: DeploymentHandle | None = None):
        """`adapter_names`: the app's AdapterNames (with `lora`); None: this replica's own registry is the record."""
        settings = settings or TextArgs()
        use_torch_threads(settings.torch_threads)
        self.metrics = ServiceMetrics("text")
        self.gate = Gate.from_env(settings.rate_limits, ADMIN_REQUESTS)
        self.names = adapter_names
        self.engine = AsyncLLMEngine.from_dir(model_dir, dtype=settings.dtype, config=settings.engine_config(),
                                              stall_s=settings.stall_seconds)
        further = settings.engine_config(first=False)
        # "" is the first model, as an unset TextRequest.model
        self.engines = {"": self.engine} | {
            name: AsyncLLMEngine.from_dir(path, dtype=settings.dtype, config=further, stall_s=settings.stall_seconds)
            for name, path in sorted(settings.models.items())}
        self.metrics.cpu_kernels(self.engine.engine.runner.cpu_kernels)
        freeze_loaded_objects()
        # The grammar engine loads in seconds: in the background, so the first structured request need not wait.
        for engine in self.engines.values():
            threading.Thread(target=engine.engine.grammars.warm_up, name="genserve-grammar-warm-up",
                             daemon=True).start()

    def _further_models(self) -> str:
        """The further models' names for an error message."""
        return ", ".join(repr(name) for name in self.engines if name) or "none"

    def _engine(self, model: str) -> AsyncLLMEngine:
        if model not in self.engines:
            raise UnknownModel(f"model {model!r} is not served here (the further models: {self._further_models()}; "
                               "unset: the first)")
        return self.engines[model]

    def _prompt_ids(self, engine: AsyncLLMEngine, prompt: str, messages: list[ChatMessageIn],
                    field: str = "prompt", req: TextIn | None = None) -> tuple[list[int], str]:
        """The prompt's token ids and, for a chat, the rendered prompt text (tools and tool turns included)."""
        tools = req.tools if req is not None else []
        size = len(prompt.encode()) + sum(len(m.content.encode()) + sum(len(c.arguments) for c in m.tool_calls)
                                          for m in messages) + sum(len(t.parameters) for t in tools)
        max_bytes = PROMPT_BYTES_PER_TOKEN * engine.max_context
        if size > max_bytes:
            raise InvalidArgument("messages" if messages else field,
                                  f"{size} bytes is more than this model's {engine.max_context}-token context "
                                  f"can hold (at most {max_bytes} bytes)")
        tokenizer = engine.tokenizer
        if not messages:
            return tokenizer.encode(prompt), ""
        try:
            text = _render(tokenizer, messages, req)
        except (ValueError, jinja2.TemplateError) as exc:  # the template refused the conversation
            raise InvalidArgument("messages", str(exc)) from exc
        return tokenizer.encode(text, add_special_tokens=False), text

    def _prepare(self, request: text_pb2.TextRequest) -> Prepared:
        req = parse(TextIn, request)
        engine = self._engine(req.model)
        if req.model and req.adapter:
            raise InvalidArgument("adapter", f"LoRA adapters apply to the app's first model, not to {req.model!r}")
        if req.adapter and engine.engine.registry is None and len(self.engines) > 1:
            # the OpenAI API sends any `model` it does not know as an adapter: say what is served instead
            raise AdapterNotFound(f"{req.adapter!r} is no LoRA adapter (this app loads none) and none of its further "
                                  f"models ({self._further_models()}; unset: the first)")
        check_conversation(req.messages)
        prompt_ids, text = self._prompt_ids(engine, req.prompt, req.messages, req=req)
        if not prompt_ids:
            raise InvalidArgument("prompt", "encodes to no tokens")
        tokenizer = engine.tokenizer
        fmt = tokenizer.tool_format
        grammar = _tool_grammar(fmt, req)
        params = req.sampling_params(room=engine.max_context - len(prompt_ids), grammar=grammar)
        return Prepared(req.model, engine, prompt_ids, params, fmt if req.tool_mode != "none" else None,
                        tokenizer.reasoning, tokenizer.reasoning and opens_thinking(text))

    # ---- LoRA adapters ----------------------------------------------------------------------------------------
    async def _follow_names(self, name: str) -> None:
        """Bring this replica's registry in line with the app's record of adapter `name` before a request uses it:
        load its folder where this replica lacks it or holds another one, forget it where it was unloaded (the
        engine then raises AdapterNotFound naming it)."""
        if not name or self.names is None:
            return
        folder = await self.names.folder.remote(name)
        engine = self.engine.engine
        held = engine.adapter_folders().get(name)
        if folder is None and held is not None:
            engine.unload_adapter(name)
        elif folder is not None and held != Path(folder):
            await asyncio.to_thread(engine.load_adapter, name, folder)
        if folder is not None and serve.get_multiplexed_model_id() == name:
            await self._resident(name)

    @serve.multiplexed(max_num_models_per_replica=-1)
    async def _resident(self, name: str) -> str:
        """Ray Serve's model multiplexing, for routing only: the names reported here make Serve send a request whose
        multiplexed model id is `name` to this replica first. The engine's registry keeps the weights (and evicts
        them past max_cpu_loras, to be read again), so nothing is evicted here (-1)."""
        return name

    def _adapters(self) -> list[str]:
        return self.engine.engine.adapters()

    async def _adapter_names(self) -> list[str]:
        """The adapters loaded in the app: the shared record's, else this replica's."""
        return await self.names.names.remote() if self.names is not None else self._adapters()

    @unary(text_pb2.LoadAdapterRequest, text_pb2.AdaptersResponse)
    async def LoadAdapter(self, request: text_pb2.LoadAdapterRequest) -> text_pb2.AdaptersResponse:
        req = parse(LoadAdapterIn, request)
        engine = self.engine.engine
        if engine.registry is None:
            raise InvalidAdapter("this server loads no LoRA adapters (its text app has no `lora` serve config)")
        # Read and checked here first: a folder that does not fit is refused before any replica would use it.
        await asyncio.to_thread(engine.load_adapter, req.name, req.path)
        if self.names is None:
            return text_pb2.AdaptersResponse(adapters=self._adapters())
        folder = engine.adapter_folders()[req.name]
        return text_pb2.AdaptersResponse(adapters=await self.names.set.remote(req.name, str(folder)))

    @unary(text_pb2.UnloadAdapterRequest, text_pb2.AdaptersResponse)
    async def UnloadAdapter(self, request: text_pb2.UnloadAdapterRequest) -> text_pb2.AdaptersResponse:
        req = parse(UnloadAdapterIn, request)
        # The record first: from then on no replica starts a request with it.
        recorded = self.names is not None and await self.names.remove.remote(req.name)
        held = req.name in self.engine.engine.adapter_folders()
        if held:
            self.engine.engine.unload_adapter(req.name)
        if not (recorded or held):
            raise AdapterNotFound(f"adapter {req.name!r} is not loaded")
        return text_pb2.AdaptersResponse(adapters=await self._adapter_names())

    def _report(self, model: str) -> None:
        """The engine's gauges and running totals to the metrics (free KV blocks: the first model's only)."""
        engine = self.engines[model]
        if not model:
            self.metrics.kv_free_blocks(engine.kv_blocks_free)
        self.metrics.engine_totals(**dataclasses.asdict(engine.engine.counters()), engine=model)

    async def _deltas(self, job: Prepared, method: str) -> AsyncIterator[Delta]:
        """The engine's deltas as they come; closing this generator aborts the request in the engine."""
        start, first = time.perf_counter(), True
        live = method == "GenerateStream"  # a unary reply is read whole: its tokens may come in lookahead bursts
        async with contextlib.aclosing(job.engine.stream(job.prompt_ids, job.params, uuid.uuid4().hex,
                                                         interactive=live)) as stream:
            async for delta in stream:
                if first and delta.token_ids:
                    self.metrics.first_token(method, time.perf_counter() - start)
                    first = False
                self.metrics.tokens(len(delta.token_ids))
                yield delta
        self._report(job.model)

    @unary(text_pb2.TextRequest, text_pb2.TextResponse)
    async def Generate(self, request: text_pb2.TextRequest) -> text_pb2.TextResponse:
        job = self._prepare(request)
        await self._follow_names(job.params.adapter)
        reply = text_pb2.TextResponse(prompt_tokens=len(job.prompt_ids), seed=job.params.seed)
        texts: list[str] = []
        async with contextlib.aclosing(self._deltas(job, "Generate")) as deltas:
            async for delta in deltas:
                texts.append(delta.text)
                reply.token_ids.extend(delta.token_ids)
                reply.logprobs.extend(_logprob_messages(delta))
                reply.finish_reason = delta.finish_reason or ""
        parsed = parse_reply("".join(texts), job.tool_format, reasoning=job.reasoning, thinking=job.thinking)
        reply.text, reply.reasoning_content = parsed.content, parsed.reasoning
        reply.tool_calls.extend(text_pb2.ToolCall(id=job.new_call_id(), name=c.name or "", arguments=c.arguments)
                                for c in parsed.calls)
        reply.finish_reason = _finish(reply.finish_reason, bool(parsed.calls))
        return reply

    @streaming(text_pb2.TextRequest)
    async def GenerateStream(self, request: text_pb2.TextRequest) -> AsyncIterator[text_pb2.TextChunk]:
        job = self._prepare(request)
        await self._follow_names(job.params.adapter)
        reader = StreamParser(job.tool_format, job.new_call_id, reasoning=job.reasoning, thinking=job.thinking)
        async with contextlib.aclosing(self._deltas(job, "GenerateStream")) as deltas:
            async for delta in deltas:
                piece = reader.feed(delta.text, final=bool(delta.finish_reason))
                yield text_pb2.TextChunk(
                    text=piece.content, token_ids=delta.token_ids,
                    finish_reason=_finish(delta.finish_reason or "", bool(reader.ids)),
                    logprobs=_logprob_messages(delta),
                    prompt_tokens=len(job.prompt_ids) if delta.finish_reason else 0,
                    reasoning_content=piece.reasoning,
                    tool_calls=[text_pb2.ToolCallDelta(index=c.index, id=c.id, name=c.name, arguments=c.arguments)
                                for c in piece.calls],
                )

    @unary(text_pb2.TokenizeRequest, text_pb2.TokenizeResponse)
    async def Tokenize(self, request: text_pb2.TokenizeRequest) -> text_pb2.TokenizeResponse:
        req = parse(TokenizeIn, request)
        engine = self._engine(req.model)
        ids, _ = self._prompt_ids(engine, req.text, req.messages, "text")
        decode = engine.tokenizer.decode
        return text_pb2.TokenizeResponse(token_ids=ids, tokens=[decode([i], skip_special_tokens=False) for i in ids])

    @unary(text_pb2.ModelInfoRequest, text_pb2.ModelInfo)
    async def GetModelInfo(self, request: text_pb2.ModelInfoRequest) -> text_pb2.ModelInfo:
        model = parse(ModelInfoIn, request).model
        engine = self._engine(model)
        info = engine.info()
        self._report(model)
        fields = text_pb2.ModelInfo.DESCRIPTOR.fields_by_name
        tokenizer = engine.tokenizer
        return text_pb2.ModelInfo(**{k: v for k, v in info.items() if k in fields},
                                  tool_format=tokenizer.tool_format, reasoning=tokenizer.reasoning,
                                  adapters=await self._adapter_names() if not model else [],
                                  models=[name for name in self.engines if name])

    def token_texts(self, token_ids: list[int], model: str = "") -> dict[int, str]:
        """Each token's text decoded on its own by base model `model`'s tokenizer, as Tokenize's `tokens` (a
        deployment-handle method for the HTTP API's logprobs, not an RPC)."""
        decode = self._engine(model).tokenizer.decode
        return {i: decode([i], skip_special_tokens=False) for i in token_ids}

    def check_health(self) -> None:
        """Ray Serve's replica health check: a failed or stalled engine loop gets the replica replaced."""
        for model, engine in self.engines.items():
            which = f"text engine {model!r}" if model else "text engine"
            if engine.error is not None:
                raise RuntimeError(f"{which} failed: {type(engine.error).__name__}")
            if engine.stalled:
                raise RuntimeError(f"{which} stalled: no step finished for {engine.progress.stall_s:.0f} s "
                                   "while requests wait")

    @unary(health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse)
    async def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        """NOT_SERVING once an engine's step loop has failed or stalled (requests would fail or wait forever)."""
        serving = all(engine.error is None and not engine.stalled for engine in self.engines.values())
        return health.check(request, SERVICE, serving=serving)


def build(args: dict[str, Any] | None = None) -> Application:
    lora = TextArgs.model_validate(args or {}).lora
    # The record of adapter names starts with the serve config's adapters, as every replica loads them at start.
    bound = () if lora is None else (AdapterNames.bind(lora.folders()),)
    return build_app("text", TextGeneration, args, TextArgs, *bound)
