"""The Responses API without a stack: input items -> chat messages, previous_response_id through the bounded store,
text.format and tools onto the TextRequest, reply objects and the typed stream events in OpenAI's order."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from genserve.services.common.errors import InvalidArgument
from genserve.services.http import responses
from genserve.services.http.errors import describe
from genserve.services.http.schemas import ResponsesBody
from genserve.v1 import text_pb2

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def body(**fields) -> ResponsesBody:
    return ResponsesBody.model_validate({"model": "text", "input": "Weather in Paris?", **fields})


def store(count: int = 10, ttl_s: float = 60.0) -> responses.ResponseStore:
    return responses.ResponseStore(count, ttl_s)


def test_input_items_become_chat_turns():
    items = body(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                   "text": "Paris?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]).input
    assert responses.input_messages(items) == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"id": "c2", "name": "get_weather", "arguments": '{"city": "Lyon"}'}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    with pytest.raises(InvalidArgument, match=r"input\[0\].call_id: is required"):
        responses.input_messages(body(input=[{"type": "function_call_output", "output": "x"}]).input)


def test_instructions_tools_and_text_format_reach_the_text_request():
    turn = responses.prepare(body(instructions="Be brief.", tools=[
        {"type": "function", "name": "get_weather", "parameters": WEATHER}],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=20, temperature=0), store())
    request = turn.request
    assert [(m.role, m.content) for m in request.messages] == [("system", "Be brief."), ("user", "Weather in Paris?")]
    assert (request.tools[0].name, json.loads(request.tools[0].parameters)) == ("get_weather", WEATHER)
    assert (request.tool_choice, request.tool_name, request.max_tokens) == ("function", "get_weather", 20)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formatted = responses.prepare(body(text={"format": {"type": "json_schema", "name": "x", "schema": schema}}),
                                  store()).request
    assert json.loads(formatted.json_schema) == schema


def test_previous_response_id_carries_the_conversation_and_unknown_ids_are_404s():
    kept = store()
    first = responses.prepare(body(instructions="Be brief."), kept)
    reply = text_pb2.TextResponse(text="Sunny.", token_ids=[1, 2], finish_reason="eos", prompt_tokens=7)
    answer = responses.reply_object(first, reply, kept)
    assert answer["status"] == "completed" and answer["output"][0]["content"][0]["text"] == "Sunny."
    assert answer["usage"]["total_tokens"] == 9
    second = responses.prepare(body(input="And tomorrow?", previous_response_id=answer["id"]), kept).request
    assert [(m.role, m.content) for m in second.messages] == [
        ("user", "Weather in Paris?"), ("assistant", "Sunny."), ("user", "And tomorrow?")]  # instructions not kept
    with pytest.raises(responses.ResponseNotFound) as error:
        responses.prepare(body(previous_response_id="resp_nope"), kept)
    status, out = describe(error.value, "rid", responses.FIELDS, responses.KNOWN)
    assert status == 404 and out["error"]["param"] == "previous_response_id"
    assert "'resp_nope'" in out["error"]["message"]
    unstored = responses.prepare(body(store=False), kept)
    responses.reply_object(unstored, reply, kept)
    with pytest.raises(responses.ResponseNotFound):
        kept.get(unstored.id)


def test_the_store_is_bounded_in_count_and_time(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(responses.time, "monotonic", lambda: clock[0])
    kept = store(count=2, ttl_s=30.0)
    for name in ("a", "b", "c"):
        kept.put(name, responses.Stored({}, []))
    assert len(kept) == 2 and kept.get("c") is not None
    with pytest.raises(responses.ResponseNotFound):
        kept.get("a")  # the oldest went past max_count
    clock[0] += 31
    assert len(kept) == 0


def test_bad_fields_name_the_body_field():
    with pytest.raises(ValidationError) as error:
        responses.prepare(body(tools=[{"type": "function", "name": "f", "parameters": {"type": "string"}}]), store())
    status, out = describe(error.value, "rid", responses.FIELDS, responses.KNOWN)
    assert status == 400 and out["error"]["param"] == "tools[0].parameters"
    with pytest.raises(InvalidArgument) as error:
        responses.prepare(body(text={"format": {"type": "json_schema", "name": "x"}}), store())
    assert error.value.field == "text.format.schema"


def test_stream_events_follow_openais_order_and_assemble_the_reply():
    kept = store()
    turn = responses.prepare(body(tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}]), kept)
    writer = responses.EventWriter(turn)
    events = writer.start()
    events += writer.chunk(text_pb2.TextChunk(text="Checking.", token_ids=[1]))
    events += writer.chunk(text_pb2.TextChunk(token_ids=[2], tool_calls=[
        text_pb2.ToolCallDelta(index=0, id="call_a", name="get_weather", arguments='{"ci')]))
    events += writer.chunk(text_pb2.TextChunk(token_ids=[3], tool_calls=[
        text_pb2.ToolCallDelta(index=0, arguments='ty":"Paris"}')]))
    last = text_pb2.TextChunk(token_ids=[4], finish_reason="tool_calls", prompt_tokens=11)
    events += writer.chunk(last) + writer.finish(last, kept)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == "Checking."
    assert {k: done["output"][1][k] for k in ("type", "call_id", "name", "arguments", "status")} == {
        "type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city":"Paris"}',
        "status": "completed"}
    assert done["usage"]["output_tokens"] == 4 and done["usage"]["input_tokens"] == 11
    assert kept.get(turn.id).conversation[-1]["tool_calls"] == [
        {"id": "call_a", "name": "get_weather", "arguments": '{"city":"Paris"}'}]
    assert responses.sse(events[0]).startswith(b"event: response.created\ndata: {")
