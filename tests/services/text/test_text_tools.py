"""Tool calling and reasoning in the text service: the prompts with tools equal transformers'
apply_chat_template(tools=...) for the Hermes/Qwen, Llama 3.1 and Mistral templates (copied from the models into
templates/), each family's parser recovers its calls whole and streamed, the grammars accept each family's calls and
nothing else, a Qwen3 template's reasoning is split from the content, and a tiny random model sampled at temperature
1.0 under "required" writes calls whose arguments validate, every time."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import transformers
import xgrammar as xgr
from tokenizers import Tokenizer

from genserve.services.text.schema import ChatMessageIn, TextIn
from genserve.services.text.tokenizer import TextTokenizer
from genserve.services.text.tools.formats import (
    ToolSpec,
    call_grammar,
    generic_messages,
    template_message,
    tool_format,
)
from genserve.services.text.tools.parsers import StreamParser, parse

TEMPLATES = Path(__file__).parent / "templates"
DEMO_TOKENIZER = "services/text/weights/tokenizer.json"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [ToolSpec("get_weather", "The forecast for a city.", WEATHER), ToolSpec("get_time", "", TIME)]
CALL_ID = "abc123XYZ"  # 9 letters and digits: what Mistral's template asks of an id


def conversation() -> list[dict]:
    """A whole tool round as an OpenAI client sends it (arguments as JSON text)."""
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris for 2 days?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": CALL_ID, "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny, 21 C"},
    ]


def hf_conversation() -> list[dict]:
    """The same conversation as a transformers user writes it (arguments as objects)."""
    out = []
    for m in conversation():
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["name"], "arguments": json.loads(c["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def tokenizers_for(template: str) -> tuple[TextTokenizer, transformers.PreTrainedTokenizerFast]:
    specials = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    ours = TextTokenizer(Tokenizer.from_file(DEMO_TOKENIZER), specials, chat_template=template)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=DEMO_TOKENIZER, chat_template=template, **specials)
    return ours, theirs


def our_ids(tokenizer: TextTokenizer, messages: list[dict], tools: list[ToolSpec], **kwargs) -> list[int]:
    validated = [ChatMessageIn.model_validate(m).model_dump() for m in messages]
    text = tokenizer.apply_chat_template([template_message(m) for m in validated],
                                         tools=[t.schema() for t in tools], **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def their_ids(tokenizer: transformers.PreTrainedTokenizerFast, messages: list[dict], tools: list[ToolSpec],
              **kwargs) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=[t.schema() for t in tools], add_generation_prompt=True,
                                        tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize(("name", "family"), [("qwen2.5", "hermes"), ("qwen3", "hermes"), ("llama3.1", "llama3"),
                                              ("mistral-nemo", "mistral")])
def test_prompt_with_tools_equals_transformers(name, family):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    assert tool_format(template) == family
    ours, theirs = tokenizers_for(template)
    for messages in (conversation()[:2], conversation()):
        assert our_ids(ours, messages, TOOLS) == their_ids(theirs, hf_conversation()[:len(messages)], TOOLS)
    if family == "hermes":  # the tool schema is in the prompt, keys in their order (transformers' tojson)
        assert '"city": {"type": "string", "maxLength": 12}' in ours.decode(our_ids(ours, conversation(), TOOLS))


def test_qwen3_thinking_switch_reaches_the_template():
    ours, theirs = tokenizers_for((TEMPLATES / "qwen3.jinja").read_text())
    assert ours.reasoning
    for enable in (True, False):
        assert (our_ids(ours, conversation()[:2], [], enable_thinking=enable)
                == their_ids(theirs, hf_conversation()[:2], [], enable_thinking=enable))
    off = ours.decode(our_ids(ours, conversation()[:2], [], enable_thinking=False), skip_special_tokens=False)
    assert off.endswith("<think>\n\n</think>\n\n")


def test_smollm2_style_template_gets_the_generic_format():
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert tool_format(chatml) == "generic"
    validated = [ChatMessageIn.model_validate(m).model_dump() for m in conversation()]
    messages = generic_messages(validated, TOOLS, "auto")
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("You are terse.\n\nYou can call")
    assert '"name": "get_weather"' in messages[0]["content"] and '{"response": ' in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {"tool_calls": [{"name": "get_weather",
                                                                  "arguments": {"city": "Paris", "days": 2}}]}
    # the tool's name comes from the call it answers (OpenAI clients send none)
    assert json.loads(messages[3]["content"]) == {"tool_response": {"name": "get_weather", "content": "sunny, 21 C"}}
    assert messages[3]["role"] == "user"


# ---- parsers -------------------------------------------------------------------------------------------------
REPLIES = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
               "Let me check."),
    "llama3": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
               '{"name": "get_time", "parameters": {"zone": "CET"}}', ""),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', ""),
    "generic": ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]}', ""),
}
EXPECTED_CALLS = [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", '{"zone": "CET"}')]


def stream(text: str, fmt: str | None, step: int = 3, **kwargs) -> tuple[str, str, list[tuple[str, str]]]:
    """Feeds `text` a few characters at a time and assembles the deltas as an OpenAI client does."""
    ids = iter(f"call_{i}" for i in range(10))
    reader = StreamParser(fmt, lambda: next(ids), **kwargs)
    content, reasoning, calls = "", "", {}
    for start in range(0, len(text), step):
        piece = reader.feed(text[start:start + step], final=start + step >= len(text))
        content, reasoning = content + piece.content, reasoning + piece.reasoning
        for c in piece.calls:
            name, args = calls.get(c.index, ("", ""))
            calls[c.index] = (name + c.name, args + c.arguments)
    return content, reasoning, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("fmt", list(REPLIES))
def test_parsers_recover_each_familys_calls_whole_and_streamed(fmt):
    text, content = REPLIES[fmt]
    parsed = parse(text, fmt)
    assert [(c.name, c.arguments) for c in parsed.calls] == EXPECTED_CALLS
    assert parsed.content == content
    for step in (1, 3, 7):
        streamed_content, _, calls = stream(text, fmt, step)
        assert calls == EXPECTED_CALLS
        assert streamed_content.strip() == content


@pytest.mark.parametrize("fmt", list(REPLIES))
def test_plain_text_stays_content(fmt):
    text = "The forecast says sun." if fmt != "generic" else '{"response": "The forecast says \\"sun\\"."}'
    expected = "The forecast says sun." if fmt != "generic" else 'The forecast says "sun".'
    assert parse(text, fmt).content == expected and not parse(text, fmt).calls
    assert stream(text, fmt, 2)[0] == expected


def test_a_call_cut_by_max_tokens_is_left_as_text():
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    parsed = parse(cut, "hermes")
    assert parsed.calls == [] and parsed.content == cut


def test_qwen3_reasoning_is_split_from_content_and_calls():
    text = '<think>\nThe user wants weather.\n</think>\n\n' + REPLIES["hermes"][0]
    parsed = parse(text, "hermes", reasoning=True)
    assert parsed.reasoning == "The user wants weather."
    assert parsed.content == "Let me check." and len(parsed.calls) == 2
    for step in (1, 4):
        content, reasoning, calls = stream(text, "hermes", step, reasoning=True)
        assert reasoning == "The user wants weather." and content.strip() == "Let me check."
        assert calls == EXPECTED_CALLS
    # DeepSeek-R1's prompt opens the section itself: the reply starts inside it.
    assert parse("hmm\n</think>\n\n42", None, reasoning=True, thinking=True).reasoning == "hmm"
    assert parse("hmm\n</think>\n\n42", None, reasoning=True, thinking=True).content == "42"


# ---- grammars ------------------------------------------------------------------------------------------------
def accepts(grammar: str, text: str) -> bool:
    return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(grammar), text)


COMPACT = {"hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","days":2}}\n</tool_call>',
                      "\n"),
           "llama3": ('{"name": "get_weather", "parameters": {"city":"Paris","days":2}}', "; "),
           "mistral": ('{"name": "get_weather", "arguments": {"city":"Paris","days":2}}', ", "),
           "generic": ('{"name": "get_weather", "arguments": {"city":"Paris","days":2}}', ", ")}
WRAP = {"mistral": ("[TOOL_CALLS][", "]"), "generic": ('{"tool_calls": [', "]}")}


@pytest.mark.parametrize("fmt", list(COMPACT))
def test_required_grammar_takes_only_valid_calls(fmt):
    call, sep = COMPACT[fmt]
    before, after = WRAP.get(fmt, ("", ""))
    grammar = call_grammar(fmt, TOOLS, "required", parallel=True)
    assert accepts(grammar, before + call + after)
    assert not accepts(grammar, before + call.replace("Paris", "Paris-Texas-USA") + after)  # maxLength 12
    assert not accepts(grammar, before + call.replace('"days":2', '"days":9') + after)  # maximum 7
    assert not accepts(grammar, before + call.replace("get_weather", "get_news") + after)
    assert not accepts(grammar, "Sure. " + before + call + after)  # nothing but calls
    assert not accepts(grammar, before + after)  # at least one
    assert accepts(grammar, before + call + sep + call + after) == (fmt != "llama3")  # Llama: one call a turn
    named = call_grammar(fmt, TOOLS[1:], "function", parallel=False)
    assert not accepts(named, before + call + after)


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_auto_grammar_leaves_text_free_until_a_call_opens(fmt):
    call, _ = COMPACT[fmt]
    before, after = WRAP.get(fmt, ("", ""))
    grammar = call_grammar(fmt, TOOLS, "auto", parallel=True)
    assert accepts(grammar, "Just text, no call.")
    assert accepts(grammar, "Checking. " + before + call + after)
    assert not accepts(grammar, "Checking. " + before + call.replace('"days":2', '"days":"two"') + after)


def test_generic_auto_grammar_is_a_call_or_a_response():
    grammar = call_grammar("generic", TOOLS, "auto", parallel=False)
    assert accepts(grammar, '{"response": "It is sunny."}')
    assert accepts(grammar, '{"tool_calls": [' + COMPACT["generic"][0] + "]}")
    assert not accepts(grammar, "It is sunny.")


# ---- the request schema --------------------------------------------------------------------------------------
def request(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "get_weather", "parameters": json.dumps(WEATHER)}], **fields}


@pytest.mark.parametrize(("fields", "where", "what"), [
    ({"tool_choice": "function", "tool_name": "nope"}, "tool_name", "not one of the request's tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be one of"),
    ({"tools": [{"name": "bad name", "parameters": "{}"}]}, "tools.0.name", "should match pattern"),
    ({"tools": [{"name": "f", "parameters": "[1]"}]}, "tools.0.parameters", "must be a JSON Schema object"),
    ({"tools": [{"name": "f", "parameters": '{"type": "string"}'}]}, "tools.0.parameters", "of type 'object'"),
    ({"tools": [{"name": "f"}, {"name": "f"}]}, "tools", "'f' repeats"),
    ({"json_schema": "{}"}, "tools", "cannot be combined"),
])
def test_bad_tool_fields_are_named(fields, where, what):
    with pytest.raises(Exception) as info:
        TextIn.model_validate(request(**fields))
    error = info.value.errors()[0]
    assert ".".join(map(str, error["loc"])) == where and what in error["msg"]


# ---- sampled calls -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo():
    from genserve.services.text.engine.async_engine import DEMO_DIR
    from genserve.services.text.engine.engine import EngineConfig, LLMEngine
    from genserve.services.text.loader import load_model

    model = load_model(DEMO_DIR)
    return LLMEngine(model, TextTokenizer.from_dir(DEMO_DIR, model.config.eos_token_ids), EngineConfig())


@pytest.mark.parametrize(("fmt", "choice", "tools"), [("generic", "required", TOOLS), ("hermes", "required", TOOLS),
                                                      ("mistral", "function", TOOLS[:1])])
def test_sampled_calls_always_validate(demo, fmt, choice, tools):
    """16 replies of the demo model at temperature 1.0 under each grammar: every one is calls, every call names a
    tool and its arguments validate against that tool's schema."""
    from genserve.services.text.engine.params import SamplingParams

    grammar = call_grammar(fmt, tools, choice, parallel=False)  # a random model would call on to max_tokens
    prompt = demo.tokenizer.encode("Call a tool:")
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, grammar=grammar) for s in range(16)]
    schemas = {t.name: t.parameters for t in tools}
    for text, _, finish_reason in demo.generate_batch([prompt] * len(params), params):
        parsed = parse(text, fmt)
        assert finish_reason in ("eos", "stop") and len(parsed.calls) == 1, text
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_parsers_never_raise_on_any_text():
    """Whatever a model writes (markup, broken JSON, raw control characters in keys), reading it never fails."""
    import random

    pieces = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"name"', '"arguments"', '"parameters"', ":", ",",
              '"', "\\", "a", " ", "\n", "\x01", "[TOOL_CALLS]", "<think>", "</think>", '"response"', '"tool_calls"',
              "<|python_tag|>", ";", "1", "\\u00e9", "\\u12"]
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        for fmt in (None, *REPLIES):
            parsed = parse(text, fmt, reasoning=True)
            assert all(c.name and c.complete for c in parsed.calls)
            stream(text, fmt, 3, reasoning=True)


def test_a_schema_xgrammar_cannot_compile_says_why_without_its_source_location():
    from genserve.services.text.tools.formats import check_schema

    with pytest.raises(ValueError) as error:
        check_schema({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}})
    assert str(error.value) == "Invalid range: minimum greater than maximum"
