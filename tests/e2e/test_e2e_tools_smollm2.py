"""Tool calling and the Responses API with the official `openai` client, against the local stack serving `make
serve`'s default model (SmolLM2-135M-Instruct, whose template has no tools: the generic format), on the shared
smollm2_stack (tests/e2e/conftest.py)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone.",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLES = 50
CONCURRENT = 16  # one batch (smollm2_stack holds text to one replica)


@pytest.fixture(scope="module")
def api(smollm2_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_stack.http_url, api_key="unused", timeout=120, max_retries=0)


def valid_calls(message) -> list[tuple[str, dict]]:
    """The message's calls, each checked against its tool's schema."""
    calls = []
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_models_say_the_generic_format(api):
    (text_model,) = [m for m in api.models.list().data if m.id == "text"]
    assert text_model.model_extra["tool_format"] == "generic" and text_model.model_extra["reasoning"] is False


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_50_sampled_calls_validate(smollm2_stack, choice):
    async def sample(client: openai.AsyncOpenAI, seed: int, gate: asyncio.Semaphore):
        async with gate:
            return await client.chat.completions.create(model="text", messages=QUESTION, tools=TOOLS,
                                                        tool_choice=choice, temperature=1.0, seed=seed, max_tokens=80)

    async def all_samples():  # a client per event loop: its connections belong to the loop that opened them
        gate = asyncio.Semaphore(CONCURRENT)
        async with openai.AsyncOpenAI(base_url=smollm2_stack.http_url, api_key="unused", timeout=600,
                                      max_retries=0) as client:
            return await asyncio.gather(*(sample(client, seed, gate) for seed in range(SAMPLES)))

    replies = asyncio.run(all_samples())
    for reply in replies:
        (choice_,) = reply.choices
        assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
        calls = valid_calls(choice_.message)
        assert len(calls) == 1
        if isinstance(choice, dict):
            assert calls[0][0] == "get_time"


def test_auto_gives_valid_calls_or_text(api):
    for seed in range(2):
        (choice,) = api.chat.completions.create(model="text", messages=QUESTION, tools=TOOLS, temperature=1.0,
                                                seed=seed, max_tokens=80).choices
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and valid_calls(choice.message)
        else:
            assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_streamed_calls_assemble_into_the_unary_ones(api):
    options = {"model": "text", "messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0,
               "seed": 7, "max_tokens": 80}
    unary = api.chat.completions.create(**options).choices[0]
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in api.chat.completions.create(**options, stream=True):
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                entry = calls.setdefault(piece.index, ["", "", ""])
                entry[0] += piece.id or ""
                entry[1] += piece.function.name or ""
                entry[2] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(name, args) for _, name, args in calls.values()] == [
        (c.function.name, c.function.arguments) for c in unary.message.tool_calls]
    assert all(call_id.startswith("call_") for call_id, _, _ in calls.values())


def test_a_tool_result_gives_a_final_answer(api):
    first = api.chat.completions.create(model="text", messages=QUESTION, tools=TOOLS,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        temperature=0, max_tokens=80).choices[0].message
    (call,) = first.tool_calls
    messages = [*QUESTION, first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees celsius."}]
    final = api.chat.completions.create(model="text", messages=messages, tools=TOOLS, tool_choice="none",
                                        temperature=0, max_tokens=40).choices[0]
    assert final.message.content and not final.message.tool_calls and final.finish_reason in ("stop", "length")


def test_unknown_tool_call_id_and_bad_schema_are_400s(api):
    with pytest.raises(openai.BadRequestError) as error:
        api.chat.completions.create(model="text", messages=[*QUESTION, {"role": "tool", "tool_call_id": "call_x",
                                                                        "content": "?"}], tools=TOOLS)
    assert error.value.body["param"] == "messages[1].tool_call_id"
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}}}]
    with pytest.raises(openai.BadRequestError) as error:
        api.chat.completions.create(model="text", messages=QUESTION, tools=bad, tool_choice="required")
    assert error.value.body["param"] == "tools[0].function.parameters"
    assert "grammar engine cannot compile" in error.value.body["message"]


# ---- the Responses API ---------------------------------------------------------------------------------------
RESPONSE_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                   "parameters": t["function"]["parameters"]} for t in TOOLS]


def test_responses_text_and_a_second_turn_that_sees_the_first(api):
    first = api.responses.create(model="text", instructions="Answer in one short sentence.",
                                 input="What is the capital of France?", temperature=0, max_output_tokens=30)
    assert first.status in ("completed", "incomplete") and "Paris" in first.output_text
    second = api.responses.create(model="text", previous_response_id=first.id, temperature=0, max_output_tokens=30,
                                  input="Repeat the city you just named, one word.")
    assert "Paris" in second.output_text
    assert api.responses.retrieve(second.id).id == second.id
    with pytest.raises(openai.NotFoundError) as error:
        api.responses.create(model="text", input="hi", previous_response_id="resp_unknown")
    assert "'resp_unknown'" in error.value.body["message"]


def test_responses_tools_format_and_stream(api):
    called = api.responses.create(model="text", input="What is the weather in Paris?", tools=RESPONSE_TOOLS,
                                  tool_choice="required", temperature=1.0, max_output_tokens=80)
    (call,) = [item for item in called.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    follow = api.responses.create(model="text", previous_response_id=called.id, tools=RESPONSE_TOOLS,
                                  tool_choice="none", temperature=0, max_output_tokens=30, input=[
                                      {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}])
    assert follow.output_text
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    shaped = api.responses.create(model="text", input="Name a city in France.", temperature=1.0, max_output_tokens=40,
                                  text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    jsonschema.validate(json.loads(shaped.output_text), schema)
    events = list(api.responses.create(model="text", input="What is the weather in Paris?", tools=RESPONSE_TOOLS,
                                       tool_choice="required", temperature=1.0, max_output_tokens=80, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [item for item in events[-1].response.output if item.type == "function_call"]
    assert arguments == done.arguments
    jsonschema.validate(json.loads(arguments), SCHEMAS[done.name])


def test_cli_chat_with_tools_prints_the_calls(smollm2_stack, tmp_path, capsys):
    from genserve.services.client.cli import main

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    assert main(["chat", "What is the weather in Paris?", "--tools", str(tools), "--tool-choice", "get_weather",
                 "--address", smollm2_stack.address, "--timeout", "120"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("call ")]
    name, rest = line.removeprefix("call ").split("(", 1)
    arguments, call_id = rest.rsplit(")  [", 1)
    assert name == "get_weather" and call_id.startswith("call_") and call_id.endswith("]")
    jsonschema.validate(json.loads(arguments), WEATHER)
