"""OpenAI's Responses API (POST /v1/responses) on the text service: a body becomes one chat TextRequest (the same
tools, grammar and parsers as Chat Completions), the reply becomes a `response` object or its typed stream events.

`previous_response_id` continues a conversation kept here, in the ingress replica's memory: each stored response
holds the whole conversation up to its reply (input items and output), at most `responses_max_count` of them for at
most `responses_ttl_s` seconds (the http app's serve-config args). `store: false` keeps nothing. With several http
replicas a follow-up may reach one that never saw the first turn, and gets the same 404 as an expired id: the store
is a convenience of one replica, not a database.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from genserve.services.common.errors import InvalidArgument, NotFound
from genserve.services.http import text
from genserve.services.http.schemas import InputItem, ResponsesBody
from genserve.services.text.schema import KNOWN_ERRORS as TEXT_ERRORS
from genserve.v1 import text_pb2

# TextIn's names -> the body's, for the `param` of an error.
FIELDS = {"max_tokens": "max_output_tokens", "json_schema": "text.format", "tool_name": "tool_choice",
          "enable_thinking": "reasoning", "adapter": "model"}


class ResponseNotFound(NotFound):
    def __init__(self, response_id: str):
        super().__init__(f"previous_response_id: no response {response_id!r} is stored here (it was never made, was "
                         "made with store: false, or has expired)")


KNOWN = {**TEXT_ERRORS, ResponseNotFound: (grpc.StatusCode.NOT_FOUND, "previous_response_id")}


@dataclass
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    at: float = field(default_factory=lambda: time.monotonic())


class ResponseStore:
    """Responses by id, the oldest dropped past `max_count`, any dropped `ttl_s` after it was made."""

    def __init__(self, max_count: int, ttl_s: float):
        self.max_count, self.ttl_s = max_count, ttl_s
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items and (len(self._items) > self.max_count
                               or now - next(iter(self._items.values())).at > self.ttl_s):
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored:
        self._expire()
        if response_id not in self._items:
            raise ResponseNotFound(response_id)
        return self._items[response_id]

    def put(self, response_id: str, stored: Stored) -> None:
        self._items[response_id] = stored
        self._expire()

    def __len__(self) -> int:
        self._expire()
        return len(self._items)


def _text(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """`input` as chat messages: consecutive function calls become one assistant turn's tool_calls, a call's output
    a tool turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if item.type == "message":
            if item.role is None:
                raise InvalidArgument(f"input[{i}].role", "is required for a message")
            messages.append({"role": "system" if item.role == "developer" else item.role,
                             "content": _text(item.content)})
        elif item.type == "function_call":
            for key in ("call_id", "name"):
                if not getattr(item, key):
                    raise InvalidArgument(f"input[{i}].{key}", "is required for a function_call item")
            call = {"id": item.call_id, "name": item.name, "arguments": item.arguments or "{}"}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item.type == "function_call_output":
            if not item.call_id:
                raise InvalidArgument(f"input[{i}].call_id", "is required for a function_call_output item")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output or ""})
    if not messages:
        raise InvalidArgument("input", "holds no message")
    return messages


def _json_schema(body: ResponsesBody) -> str | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return '{"type": "object"}'
    if fmt.schema_ is None:
        raise InvalidArgument("text.format.schema", "is required when type is 'json_schema'")
    return json.dumps(fmt.schema_)


@dataclass
class Turn:
    """One /v1/responses call: its TextRequest, the conversation so far, and the response skeleton."""

    body: ResponsesBody
    request: text_pb2.TextRequest
    conversation: list[dict[str, Any]]
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))

    def skeleton(self, status: str) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else {
            "type": "text"}
        choice = body.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": body.model,
            "output": [], "error": None, "incomplete_details": None, "instructions": body.instructions,
            "metadata": body.metadata or {}, "parallel_tool_calls": bool(body.parallel_tool_calls),
            "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str) else
            (choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": {"format": fmt}, "previous_response_id": body.previous_response_id, "store": body.store,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "truncation": "disabled", "user": body.user, "usage": None,
        }

    def finish(self, output: list[dict[str, Any]], reply_text: str, calls: list[dict[str, Any]], finish_reason: str,
               prompt_tokens: int, completion_tokens: int, store: ResponseStore) -> dict[str, Any]:
        """The completed response object; kept for previous_response_id unless the body said store: false."""
        incomplete = finish_reason in ("length", "context_length")
        response = self.skeleton("incomplete" if incomplete else "completed")
        response["output"] = output
        if incomplete:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        response["usage"] = {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": prompt_tokens + completion_tokens}
        if self.body.store:
            said: dict[str, Any] = {"role": "assistant", "content": reply_text}
            if calls:
                said["tool_calls"] = calls
            store.put(self.id, Stored(response, [*self.conversation, said]))
        return response


def prepare(body: ResponsesBody, store: ResponseStore, target: Mapping[str, str] | None = None) -> Turn:
    """The body's TextRequest: the stored conversation of previous_response_id (its instructions are not carried
    over, as at OpenAI), this body's instructions as the system message, then its input. `target`: the body's model
    as TextRequest fields (text.model_fields; None: as if the text app had one base model)."""
    earlier = store.get(body.previous_response_id).conversation if body.previous_response_id else []
    conversation = [*earlier, *input_messages(body.input)]
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    source: dict[str, Any] = {"messages": [*system, *conversation], **text.target_fields(body.model, target)}
    choice = body.tool_choice
    named = choice if choice is not None and not isinstance(choice, str) else None
    source |= text.tool_fields([t.model_dump() for t in body.tools or []], "function" if named else choice,
                               named.name if named else None, body.parallel_tool_calls)
    if body.reasoning and body.reasoning.effort:
        source["reasoning_effort"] = body.reasoning.effort
    sampling = {"max_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
                "seed": body.seed, "json_schema": _json_schema(body)}
    (request,) = text._requests([source], {k: v for k, v in sampling.items() if v is not None}, 1)
    return Turn(body, request, conversation)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, content: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": content, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [part] if status == "completed" else []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _reasoning_item(item_id: str, reasoning: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": reasoning}] if reasoning else []}


def reply_object(turn: Turn, reply: text_pb2.TextResponse, store: ResponseStore) -> dict[str, Any]:
    output = []
    if reply.reasoning_content:
        output.append(_reasoning_item(_id("rs"), reply.reasoning_content))
    if reply.text or not reply.tool_calls:
        output.append(_message_item(_id("msg"), reply.text, "completed"))
    calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in reply.tool_calls]
    output += [_call_item(_id("fc"), c["id"], c["name"], c["arguments"], "completed") for c in calls]
    return turn.finish(output, reply.text, calls, reply.finish_reason, reply.prompt_tokens, len(reply.token_ids),
                       store)


@dataclass
class _Open:
    kind: str  # "reasoning", "message" or "call"
    index: int  # output_index
    item: dict[str, Any]
    text: str = ""


class EventWriter:
    """A reply's stream events, in OpenAI's order: created, in_progress, then per output item `output_item.added`,
    its deltas and its `.done` events, and `response.completed` (or `.incomplete`) with the whole response."""

    def __init__(self, turn: Turn):
        self.turn = turn
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: _Open | None = None
        self.calls: dict[int, _Open] = {}
        self.completion_tokens = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        skeleton = self.turn.skeleton("in_progress")
        return [self._event("response.created", response=skeleton),
                self._event("response.in_progress", response=skeleton)]

    def _close(self) -> list[dict[str, Any]]:
        open_, self.open = self.open, None
        if open_ is None:
            return []
        where = {"item_id": open_.item["id"], "output_index": open_.index}
        if open_.kind == "reasoning":
            item = _reasoning_item(open_.item["id"], open_.text)
            events = [self._event("response.reasoning_text.done", **where, content_index=0, text=open_.text)]
        elif open_.kind == "message":
            item = _message_item(open_.item["id"], open_.text, "completed")
            events = [self._event("response.output_text.done", **where, content_index=0, text=open_.text,
                                  logprobs=[]),
                      self._event("response.content_part.done", **where, content_index=0, part=item["content"][0])]
        else:
            item = {**open_.item, "arguments": open_.text, "status": "completed"}
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=open_.text)]
        self.output[open_.index] = item
        return [*events, self._event("response.output_item.done", output_index=open_.index, item=item)]

    def _open(self, kind: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.open = _Open(kind, len(self.output), item)
        self.output.append(item)
        events.append(self._event("response.output_item.added", output_index=self.open.index, item=item))
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=self.open.index, content_index=0, part=part))
        return events

    def chunk(self, chunk: text_pb2.TextChunk) -> list[dict[str, Any]]:
        self.completion_tokens += len(chunk.token_ids)
        events: list[dict[str, Any]] = []
        if chunk.reasoning_content:
            if self.open is None or self.open.kind != "reasoning":
                events += self._open("reasoning", {"type": "reasoning", "id": _id("rs"), "summary": [],
                                                   "content": []})
            self.open.text += chunk.reasoning_content
            events.append(self._event("response.reasoning_text.delta", item_id=self.open.item["id"],
                                      output_index=self.open.index, content_index=0,
                                      delta=chunk.reasoning_content))
        if chunk.text:
            if self.open is None or self.open.kind != "message":
                events += self._open("message", _message_item(_id("msg"), "", "in_progress"))
            self.open.text += chunk.text
            events.append(self._event("response.output_text.delta", item_id=self.open.item["id"],
                                      output_index=self.open.index, content_index=0, delta=chunk.text, logprobs=[]))
        for piece in chunk.tool_calls:
            if piece.id:
                events += self._open("call", _call_item(_id("fc"), piece.id, piece.name, "", "in_progress"))
                self.calls[piece.index] = self.open
            open_ = self.calls.get(piece.index)
            if open_ is None or not piece.arguments:
                continue
            open_.text += piece.arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=open_.item["id"],
                                      output_index=open_.index, delta=piece.arguments))
        return events

    def finish(self, chunk: text_pb2.TextChunk, store: ResponseStore) -> list[dict[str, Any]]:
        events = self._close()
        if not self.output:  # a reply with no text at all still has its (empty) message
            events += self._open("message", _message_item(_id("msg"), "", "in_progress")) + self._close()
        text_ = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message" and i["content"])
        calls = [{"id": i["call_id"], "name": i["name"], "arguments": i["arguments"]}
                 for i in self.output if i["type"] == "function_call"]
        response = self.turn.finish(self.output, text_, calls, chunk.finish_reason, chunk.prompt_tokens,
                                    self.completion_tokens, store)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=response)]


async def events(turn: Turn, chunks: AsyncIterator[text_pb2.TextChunk], store: ResponseStore,
                 charge: Callable[[text_pb2.TextChunk], None]) -> AsyncIterator[dict[str, Any]]:
    """The stream's events as dicts, from the text service's chunks."""
    writer = EventWriter(turn)
    for event in writer.start():
        yield event
    async for chunk in chunks:
        charge(chunk)
        for event in writer.chunk(chunk):
            yield event
        if chunk.finish_reason:
            for event in writer.finish(chunk, store):
                yield event


def sse(event: dict[str, Any]) -> bytes:
    """One typed server-sent event: `event: <type>` and its data, as OpenAI sends them."""
    return f"event: {event['type']}\n".encode() + text.sse(event)
