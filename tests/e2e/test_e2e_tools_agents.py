"""Two agent frameworks from PyPI run a two-tool agent loop to its end against the default model (SmolLM2-135M) on
the shared smollm2_stack: the OpenAI Agents SDK (`openai-agents`, its Chat Completions model) and LangChain's
`ChatOpenAI.bind_tools`. Each loop is model -> get_weather -> model -> get_time -> model -> answer, with the
frameworks' own tool-call parsing, tool execution and tool-result messages.

A 135M model left to `auto` repeats its first call for ever (seen: six get_weather calls in six turns), so each turn
names the tool it must call through the frameworks' own tool_choice, the way an application steers a small model;
the server's grammar makes those calls valid. The last turn has tool_choice "none" and must answer in text."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

pytestmark = pytest.mark.slow
CITY = "Paris"
PLAN = ("get_weather", "get_time", "none")  # the tool_choice of each model turn


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny and 24 C in {city}."


def get_time(city: str) -> str:
    """The local time in a city."""
    return f"It is 14:05 in {city}."


def test_openai_agents_sdk_runs_a_two_tool_loop_to_the_end(smollm2_stack):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunHooks,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no export to OpenAI's tracing service
    called: list[tuple[str, str]] = []

    @function_tool(name_override="get_weather")
    def weather(city: str) -> str:
        """The current weather in a city."""
        called.append(("get_weather", city))
        return get_weather(city)

    @function_tool(name_override="get_time")
    def local_time(city: str) -> str:
        """The local time in a city."""
        called.append(("get_time", city))
        return get_time(city)

    class Plan(RunHooks):
        """After each tool, the next turn's tool_choice (the SDK reads the agent's settings every turn)."""

        async def on_tool_end(self, context, agent, tool, result) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice=PLAN[len(called)])

    async def run():
        async with AsyncOpenAI(base_url=smollm2_stack.http_url, api_key="unused", timeout=300) as client:
            agent = Agent(name="weather-desk", instructions="Use the tools, then answer the user in one sentence.",
                          tools=[weather, local_time], reset_tool_choice=False,
                          model=OpenAIChatCompletionsModel(model="text", openai_client=client),
                          model_settings=ModelSettings(tool_choice=PLAN[0], temperature=0, max_tokens=60))
            return await Runner.run(agent, f"What are the weather and the local time in {CITY}?", hooks=Plan(),
                                    max_turns=len(PLAN))

    result = asyncio.run(run())
    assert [name for name, _ in called] == ["get_weather", "get_time"]
    assert all(city.strip() for _, city in called)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "tool_call_item", "tool_call_output_item",
                     "message_output_item"]


def test_langchain_bind_tools_runs_a_two_tool_loop_to_the_end(smollm2_stack):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    tools = {t.name: t for t in (tool(get_weather), tool(get_time))}
    llm = ChatOpenAI(base_url=smollm2_stack.http_url, api_key="unused", model="text", temperature=0, max_tokens=60,
                     timeout=300, max_retries=0)
    messages = [SystemMessage("Use the tools, then answer the user in one sentence."),
                HumanMessage(f"What are the weather and the local time in {CITY}?")]
    for choice in PLAN:
        reply = llm.bind_tools(list(tools.values()), tool_choice=choice).invoke(messages)
        assert isinstance(reply, AIMessage)
        messages.append(reply)
        if choice == "none":
            break
        (call,) = reply.tool_calls
        assert call["name"] == choice and call["args"]["city"].strip()
        messages.append(tools[call["name"]].invoke(call))  # a ToolMessage with the call's id
    assert not messages[-1].tool_calls and messages[-1].content.strip()
    assert [type(m).__name__ for m in messages] == ["SystemMessage", "HumanMessage", "AIMessage", "ToolMessage",
                                                    "AIMessage", "ToolMessage", "AIMessage"]
