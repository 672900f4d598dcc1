"""Tools in the HTTP API without a stack: a chat body's tools, tool_choice and tool turns become TextRequest fields,
bad ones are 400s naming the field as the body spells it, and replies and stream chunks carry tool_calls and
reasoning_content in OpenAI's shapes."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from genserve.services.common.errors import InvalidArgument
from genserve.services.http import text
from genserve.services.http.app import TEXT_ERRORS
from genserve.services.http.errors import describe
from genserve.services.http.schemas import ChatBody
from genserve.v1 import text_pb2

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Forecast.", "parameters": WEATHER}}
ROUND = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def chat(**fields) -> ChatBody:
    return ChatBody.model_validate({"model": "text", "messages": ROUND, "tools": [TOOL], **fields})


def error_of(body: ChatBody) -> tuple[int, dict]:
    with pytest.raises((ValidationError, InvalidArgument)) as error:
        text.chat_job(body)
    status, out = describe(error.value, "rid", text.body_fields(body), TEXT_ERRORS)
    return status, out["error"]


def test_tools_and_tool_turns_map_onto_the_text_request():
    (request,) = text.chat_job(chat(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                    parallel_tool_calls=False, reasoning_effort="low",
                                    chat_template_kwargs={"enable_thinking": False})).requests
    assert [(t.name, t.description, json.loads(t.parameters)) for t in request.tools] == [
        ("get_weather", "Forecast.", WEATHER)]
    assert (request.tool_choice, request.tool_name, request.parallel_tool_calls) == ("function", "get_weather", False)
    assert request.reasoning_effort == "low" and request.HasField("enable_thinking") and not request.enable_thinking
    call = request.messages[1].tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Paris"}')
    assert request.messages[1].content == "" and request.messages[2].tool_call_id == "call_1"
    (plain,) = text.chat_job(chat(tool_choice="required")).requests
    assert plain.tool_choice == "required" and not plain.HasField("parallel_tool_calls")


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "'get_time' is not one of the request's tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters", "of type 'object'"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "pattern"),
    ({"messages": [*ROUND[:1], {**ROUND[1], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "must be a JSON object"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "'required' needs tools"),
    ({"response_format": {"type": "json_object"}}, "tools", "cannot be combined"),
])
def test_bad_tool_fields_are_400s_naming_the_body_field(fields, param, says):
    status, error = error_of(chat(**fields))
    assert status == 400 and error["param"] == param and says in error["message"], error


def test_a_tool_turn_without_a_known_call_is_named_by_the_text_service():
    from genserve.services.text.schema import TextIn, check_conversation

    (request,) = text.chat_job(chat(messages=[ROUND[0], {**ROUND[2], "tool_call_id": "call_9"}])).requests
    with pytest.raises(InvalidArgument) as error:
        check_conversation(TextIn.model_validate({"messages": [
            {"role": m.role, "content": m.content, "tool_call_id": m.tool_call_id} for m in request.messages]}
        ).messages)
    status, body = describe(error.value, "rid", text.body_fields(chat()), TEXT_ERRORS)
    assert status == 400 and body["error"]["param"] == "messages[1].tool_call_id"
    assert "'call_9' answers no tool call" in body["error"]["message"]


def test_reply_with_calls_has_null_content_and_finish_reason_tool_calls():
    job = text.chat_job(chat())
    reply = text_pb2.TextResponse(finish_reason="tool_calls", prompt_tokens=5, token_ids=[1, 2],
                                  reasoning_content="Paris, so the weather tool.",
                                  tool_calls=[text_pb2.ToolCall(id="call_a", name="get_weather",
                                                                arguments='{"city":"Paris"}')])
    (choice,) = text.chat_reply("text", job, [reply], {})["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": None,
                                 "reasoning_content": "Paris, so the weather tool.",
                                 "tool_calls": [{"id": "call_a", "type": "function",
                                                 "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]}


def test_stream_deltas_carry_call_pieces_as_openai_sends_them():
    writer = text.ChunkWriter(True, "text", text.chat_job(chat(stream=True)), include_usage=False)
    first = writer.chunk(0, text_pb2.TextChunk(token_ids=[1], tool_calls=[
        text_pb2.ToolCallDelta(index=0, id="call_a", name="get_weather", arguments='{"ci')]), {})
    more = writer.chunk(0, text_pb2.TextChunk(token_ids=[2], tool_calls=[
        text_pb2.ToolCallDelta(index=0, arguments='ty":"Paris"}')]), {})
    last = writer.chunk(0, text_pb2.TextChunk(token_ids=[3], finish_reason="tool_calls"), {})
    assert first["choices"][0]["delta"] == {"tool_calls": [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}]}
    assert more["choices"][0]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"Paris"}'}}]}
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    thinking = writer.chunk(0, text_pb2.TextChunk(token_ids=[4], reasoning_content="hm"), {})
    assert thinking["choices"][0]["delta"] == {"reasoning_content": "hm"}
