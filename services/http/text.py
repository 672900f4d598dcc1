"""OpenAI completions and chat <-> genserve.v1.TextRequest, TextResponse and TextChunk.

A body becomes one TextRequest per choice (each prompt times `n`), validated against the gRPC handler's TextIn
first so both protocols share one set of limits. With a seed, choice j samples with seed + j: the choices differ
and the same body gives the same texts again.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from genserve.services.common.errors import InvalidArgument
from genserve.services.http.schemas import MAX_CHOICES, ChatBody, ChatMessage, CompletionBody, Sampling
from genserve.services.text.schema import TEXT_MODEL_ID, TextIn
from genserve.shared.seeds import MAX_SEED
from genserve.v1 import text_pb2

# The text app's first model's id in the OpenAI API; any other `model` of a text body names one of its further base
# models (serve config `models`) or a LoRA adapter.
BASE_MODEL = TEXT_MODEL_ID
# The engine's finish reasons in OpenAI's words.
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length", "context_length": "length",
                 "tool_calls": "tool_calls"}
# Token id -> its text, decoded on its own (the text service's token_texts).
TokenTexts = Mapping[int, str]


@dataclass(frozen=True)
class TextJob:
    """What one body asks of the text service: a TextRequest per choice (choice i is prompt i // n, sample
    i % n) and how many top alternatives to return per token (None: no logprobs)."""

    requests: tuple[text_pb2.TextRequest, ...]
    n: int
    top_logprobs: int | None


def model_fields(model: str, served: Collection[str]) -> dict[str, str]:
    """TextRequest's `model` or `adapter` for a body's `model`: neither for the first model, `model` for one of the
    text app's further base models (`served`, ModelInfo.models), else `adapter`: the LoRA adapter of that name."""
    if model == BASE_MODEL:
        return {}
    return {"model": model} if model in served else {"adapter": model}


def target_fields(model: str, target: Mapping[str, str] | None) -> Mapping[str, str]:
    """`target`, or, where the caller has none, `model` read as if the text app had one base model."""
    return model_fields(model, ()) if target is None else target


def body_fields(body: ChatBody | CompletionBody) -> dict[str, str]:
    """The body's names for TextIn's fields, for the `param` of an error ("[]" stands for any index)."""
    fields = {"json_schema": "response_format", "regex": "response_format", "adapter": "model"}
    if isinstance(body, ChatBody):
        fields |= {"logprobs": "top_logprobs", "tool_name": "tool_choice", "tools[].": "tools[].function.",
                   "messages[].tool_calls[].": "messages[].tool_calls[].function.",
                   "enable_thinking": "chat_template_kwargs.enable_thinking"}
        if body.max_completion_tokens is not None:
            fields["max_tokens"] = "max_completion_tokens"
    return fields


def _sampling(body: Sampling, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    fields = {
        "max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
        "stop": stop, "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "logprobs": logprobs, "json_schema": _json_schema(body), "speculative": body.speculative,
    }
    return {k: v for k, v in fields.items() if v is not None}


def _json_schema(body: Sampling) -> str | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json.dumps({"type": "object"})
    if fmt.json_schema is None:
        raise InvalidArgument("response_format.json_schema", "is required when type is 'json_schema'")
    return json.dumps(fmt.json_schema.schema_)


def _requests(sources: list[dict[str, Any]], sampling: dict[str, Any], n: int) -> tuple[text_pb2.TextRequest, ...]:
    """Validate each source (prompt or messages) with the sampling fields against TextIn, then build the
    requests; fields left unset keep TextIn's documented defaults."""
    for source in sources:
        TextIn.model_validate({**source, **sampling})
    out = []
    for source in sources:
        for j in range(n):
            fields = dict(sampling)
            if "seed" in fields:
                fields["seed"] = (fields["seed"] + j) % (MAX_SEED + 1)
            out.append(text_pb2.TextRequest(**source, **fields))
    return tuple(out)


def _logprobs_in(top: int | None, asked: bool) -> int | None:
    """TextIn's `logprobs` for a body: 0 alternatives still needs the chosen token's logprob (1, sliced off)."""
    if not asked:
        return None
    return top if top else 1


def _content(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    return "".join(part.text for part in message.content)


def _message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                           "content": _content(message)}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.role == "tool" and message.name:
        out["name"] = message.name
    return out


def tool_fields(tools: list[dict[str, Any]] | None, choice: str | None, name: str | None,
                parallel: bool | None) -> dict[str, Any]:
    """TextRequest's tool fields: `tools` as [{name, description, parameters (a dict or None)}]; `choice` "none",
    "auto", "required" or "function" (then `name`)."""
    out: dict[str, Any] = {}
    if tools:
        out["tools"] = [{"name": t["name"], "description": t.get("description") or "",
                         "parameters": json.dumps(t["parameters"]) if t.get("parameters") is not None else ""}
                        for t in tools]
    if choice:
        out["tool_choice"] = choice
    if name:
        out["tool_name"] = name
    if parallel is not None:
        out["parallel_tool_calls"] = parallel
    return out


def chat_job(body: ChatBody, target: Mapping[str, str] | None = None) -> TextJob:
    """`target`: the body's model as TextRequest fields (model_fields; None: as if the app had one base model)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidArgument("top_logprobs", "needs logprobs: true")
    source: dict[str, Any] = {"messages": [_message(m) for m in body.messages], **target_fields(body.model, target)}
    choice = body.tool_choice
    named = choice if choice is not None and not isinstance(choice, str) else None
    source |= tool_fields([t.function.model_dump() for t in body.tools or []],
                          "function" if named else choice, named.function.name if named else None,
                          body.parallel_tool_calls)
    if body.reasoning_effort:
        source["reasoning_effort"] = body.reasoning_effort
    if body.chat_template_kwargs and body.chat_template_kwargs.enable_thinking is not None:
        source["enable_thinking"] = body.chat_template_kwargs.enable_thinking
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = _sampling(body, max_tokens, _logprobs_in(body.top_logprobs, body.logprobs))
    return TextJob(_requests([source], sampling, body.n), body.n,
                   (body.top_logprobs or 0) if body.logprobs else None)


def completion_job(body: CompletionBody, target: Mapping[str, str] | None = None) -> TextJob:
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompts:
        raise InvalidArgument("prompt", "must not be empty")
    if len(prompts) * body.n > MAX_CHOICES:
        raise InvalidArgument("n", f"prompts times n must be at most {MAX_CHOICES}")
    asked = body.logprobs is not None
    sampling = _sampling(body, body.max_tokens, _logprobs_in(body.logprobs, asked))
    sources = [{"prompt": p, **target_fields(body.model, target)} for p in prompts]
    return TextJob(_requests(sources, sampling, body.n), body.n, body.logprobs if asked else None)


# ---- replies -----------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(reason: str) -> str | None:
    return FINISH_REASON.get(reason) if reason else None


def logprob_ids(logprobs: Iterable[text_pb2.TokenLogprob]) -> set[int]:
    """Every token id a reply's logprobs name (chosen and alternatives): what to ask the tokenizer for."""
    return {i for lp in logprobs for i in (lp.token_id, *(t.token_id for t in lp.top))}


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(logprobs: Iterable[text_pb2.TokenLogprob], top: int, texts: TokenTexts) -> dict[str, Any]:
    return {"content": [
        {**_entry(texts[lp.token_id], lp.logprob),
         "top_logprobs": [_entry(texts[t.token_id], t.logprob) for t in lp.top[:top]]}
        for lp in logprobs
    ]}


def completion_logprobs(logprobs: Iterable[text_pb2.TokenLogprob], top: int, texts: TokenTexts,
                        offset: int = 0) -> dict[str, Any]:
    tokens, offsets = [], []
    logprobs = list(logprobs)
    for lp in logprobs:
        offsets.append(offset)
        tokens.append(texts[lp.token_id])
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{texts[t.token_id]: t.logprob for t in lp.top[:top]} for lp in logprobs],
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def prompt_tokens(job: TextJob, counts: Iterable[int]) -> int:
    """The prompt tokens of a body: each prompt once, however many choices it has."""
    return sum(list(counts)[:: job.n])


def tool_calls(calls: Iterable[text_pb2.ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def chat_message(reply: text_pb2.TextResponse) -> dict[str, Any]:
    """The assistant's message: content null when it only called tools, as OpenAI's."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text or (None if reply.tool_calls else "")}
    if reply.reasoning_content:
        message["reasoning_content"] = reply.reasoning_content
    if reply.tool_calls:
        message["tool_calls"] = tool_calls(reply.tool_calls)
    return message


def chat_reply(model: str, job: TextJob, replies: list[text_pb2.TextResponse], texts: TokenTexts) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "message": chat_message(r),
            "logprobs": chat_logprobs(r.logprobs, job.top_logprobs, texts) if job.top_logprobs is not None else None,
            "finish_reason": finish_reason(r.finish_reason),
        }
        for i, r in enumerate(replies)
    ]
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": _usage_of(job, replies)}


def completion_reply(model: str, job: TextJob, replies: list[text_pb2.TextResponse], texts: TokenTexts
                     ) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "text": r.text,
            "logprobs": completion_logprobs(r.logprobs, job.top_logprobs, texts)
            if job.top_logprobs is not None else None,
            "finish_reason": finish_reason(r.finish_reason),
        }
        for i, r in enumerate(replies)
    ]
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": _usage_of(job, replies)}


def _usage_of(job: TextJob, replies: list[text_pb2.TextResponse]) -> dict[str, int]:
    return usage(prompt_tokens(job, (r.prompt_tokens for r in replies)), sum(len(r.token_ids) for r in replies))


@dataclass
class ChunkWriter:
    """Builds the `data:` objects of one streamed reply (chat or completion) from TextChunks as they come."""

    chat: bool
    model: str
    job: TextJob
    include_usage: bool

    def __post_init__(self) -> None:
        self.id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = int(time.time())
        self.offsets = [0] * len(self.job.requests)
        self.completion_tokens = 0
        self.prompt_lengths = [0] * len(self.job.requests)  # from each choice's last chunk

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            out["usage"] = None
        return out

    def roles(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role, as OpenAI does."""
        if not self.chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(len(self.job.requests))]

    def chunk(self, index: int, chunk: text_pb2.TextChunk, texts: TokenTexts) -> dict[str, Any]:
        self.completion_tokens += len(chunk.token_ids)
        self.prompt_lengths[index] = chunk.prompt_tokens or self.prompt_lengths[index]
        top = self.job.top_logprobs
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = chat_delta(chunk)
            choice["logprobs"] = chat_logprobs(chunk.logprobs, top, texts) if top is not None else None
        else:
            choice["text"] = chunk.text
            choice["logprobs"] = (completion_logprobs(chunk.logprobs, top, texts, self.offsets[index])
                                  if top is not None else None)
            self.offsets[index] += len(chunk.text)
        choice["finish_reason"] = finish_reason(chunk.finish_reason)
        return self._chunk([choice])

    def usage_chunk(self) -> dict[str, Any]:
        """The usage of the whole stream, once every choice's last chunk is in."""
        out = self._chunk([])
        out["usage"] = usage(prompt_tokens(self.job, self.prompt_lengths), self.completion_tokens)
        return out


def chat_delta(chunk: text_pb2.TextChunk) -> dict[str, Any]:
    """A chunk's `delta`: content, reasoning_content and tool-call pieces (a call's first piece carries its id, type
    and name, later ones only more arguments, as OpenAI streams them)."""
    delta: dict[str, Any] = {}
    if chunk.text or not (chunk.finish_reason or chunk.tool_calls or chunk.reasoning_content):
        delta["content"] = chunk.text
    if chunk.reasoning_content:
        delta["reasoning_content"] = chunk.reasoning_content
    if chunk.tool_calls:
        delta["tool_calls"] = [
            {"index": c.index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            if c.id else {"index": c.index, "function": {"arguments": c.arguments}}
            for c in chunk.tool_calls
        ]
    return delta


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()

