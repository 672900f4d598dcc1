"""Tool-call formats: which one a chat template speaks, how a conversation with tools reaches the template, and the
grammar that the calls are generated under.

The format is read from the template, never from the model's name (llama.cpp's common/chat.cpp and vLLM's tool
parsers do the same):

    hermes   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call (Qwen2.5, Qwen3, Hermes)
    llama3   {"name": ..., "parameters": {...}}, the whole reply (Llama 3.1-3.3; one call per turn)
    mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (Mistral Nemo / v3 tokenizers)
    generic  templates that render no tools (SmolLM2): the tools are described in the system message and the
             reply is one JSON object, {"tool_calls": [...]} or {"response": "..."} (llama.cpp's generic format)

The grammars are xgrammar structural tags (Dong et al. 2024) turned into EBNF for the engine's compiler:
"required" and a named function constrain the whole reply to calls; "auto" leaves the text free until the model
writes the format's opening (`<tool_call>`, `{"name": `, `[TOOL_CALLS]`) and constrains the call from there; the
generic format is JSON from its first character, so "auto" there is a choice between the two envelopes. Every call's
arguments follow the tool's own JSON Schema (compact JSON, engine/grammar.py's json_grammar).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FORMATS = ("hermes", "llama3", "mistral", "generic")
CHOICES = ("auto", "none", "required", "function")


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema, as templates (and transformers' apply_chat_template(tools=...)) take it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


def tool_format(template: str | None) -> str:
    """The tool-call format a chat template speaks ("generic" when it renders no tools)."""
    if not template or "tools" not in template:
        return "generic"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "ipython" in template or '"parameters"' in template:
        return "llama3"
    return "generic"


def has_reasoning(template: str | None) -> bool:
    """The template knows a thinking section (Qwen3, DeepSeek-R1 style)."""
    return bool(template) and "</think>" in template


def opens_thinking(prompt: str) -> bool:
    """The rendered prompt ends inside a thinking section, so the reply starts in it (DeepSeek-R1's templates)."""
    return prompt.rstrip().endswith("<think>")


# ---- the conversation ------------------------------------------------------------------------------------------
def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as templates read it: OpenAI's shape, arguments as objects (templates write them with tojson),
    and only the keys that are set (Llama 3's template tests `'tool_calls' in message`)."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content", "")}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": json.loads(c["arguments"] or "{}")}}
            for c in message["tool_calls"]
        ]
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("name"):
        out["name"] = message["name"]
    return out


def generic_instructions(tools: list[ToolSpec], choice: str) -> str:
    """The system-message text that describes the tools and the reply's JSON to a template without tools."""
    listed = json.dumps([t.schema()["function"] for t in tools], ensure_ascii=False)
    calls = '{"tool_calls": [{"name": "<tool name>", "arguments": {...}}]}'
    if choice in ("required", "function"):
        how = f"Respond with a JSON object that calls the tools: {calls}"
    else:
        how = (f'Respond with a JSON object: either {calls} to call tools, or {{"response": "<your answer>"}} to '
               "answer the user directly. Once a tool has answered, use its result in your response instead of "
               "calling it again")
    return f"You can call these tools:\n{listed}\n\n{how}."


def generic_messages(messages: list[dict[str, Any]], tools: list[ToolSpec], choice: str) -> list[dict[str, Any]]:
    """The conversation for a template without tools: the tools in the system message, the assistant's calls and
    answers as the JSON it is asked to write, each tool result as a user turn that names its tool."""
    out, names = [], {}
    for m in messages:
        names |= {c["id"]: c["name"] for c in m.get("tool_calls") or ()}
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["name"], "arguments": json.loads(c["arguments"] or "{}")} for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
        elif m["role"] == "assistant" and tools and choice != "none":
            out.append({"role": "assistant", "content": json.dumps({"response": m["content"]}, ensure_ascii=False)})
        elif m["role"] == "tool":
            # The tool's name from the call it answers, when the client sent none (OpenAI's clients do not).
            result = {"tool_response": {"name": m.get("name") or names.get(m.get("tool_call_id"), ""),
                                        "content": m["content"]}}
            out.append({"role": "user", "content": json.dumps(result, ensure_ascii=False)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools and choice != "none":
        text = generic_instructions(tools, choice)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


# ---- the grammar -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Syntax:
    """How one format writes calls: each call's opening (before its arguments) and closing, the text between
    calls, the text around all of them, and what starts a call inside free text (for "auto")."""

    call_open: str  # with {name}
    call_close: str
    separator: str
    before: str = ""
    after: str = ""
    trigger: str = ""


SYNTAX = {
    "hermes": Syntax('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>", "\n",
                     trigger="<tool_call>"),
    "llama3": Syntax('{{"name": "{name}", "parameters": ', "}", "; ", trigger='{"name": '),
    "mistral": Syntax('{{"name": "{name}", "arguments": ', "}", ", ", before="[TOOL_CALLS][", after="]",
                      trigger="[TOOL_CALLS]"),
    "generic": Syntax('{{"name": "{name}", "arguments": ', "}", ", ", before='{"tool_calls": [', after="]}"),
}
# A JSON string, for the generic format's {"response": ...} envelope.
_STRING_SCHEMA = '{"type": "string"}'


def _tags(syntax: Syntax, tools: list[ToolSpec], json_grammar: Any) -> list[dict[str, Any]]:
    return [{"type": "tag", "begin": syntax.call_open.format(name=t.name),
             "content": {"type": "grammar", "grammar": json_grammar(json.dumps(t.parameters))},
             "end": syntax.call_close} for t in tools]


def _calls(syntax: Syntax, tools: list[ToolSpec], parallel: bool, json_grammar: Any) -> dict[str, Any]:
    calls = {"type": "tags_with_separator", "tags": _tags(syntax, tools, json_grammar),
             "separator": syntax.separator, "at_least_one": True, "stop_after_first": not parallel}
    if not (syntax.before or syntax.after):
        return calls
    return {"type": "sequence", "elements": [{"type": "const_string", "value": syntax.before}, calls,
                                             {"type": "const_string", "value": syntax.after}]}


def structural_tag(fmt: str, tools: list[ToolSpec], choice: str, parallel: bool) -> dict[str, Any] | None:
    """The structural tag the reply follows, None when it is free ("none"). `tools` are the callable ones (the
    named function alone for "function")."""
    from genserve.services.text.engine.grammar import json_grammar

    if choice == "none" or not tools:
        return None
    syntax = SYNTAX[fmt]
    parallel = parallel and fmt != "llama3"  # Llama 3's templates refuse a turn with several calls
    if choice in ("required", "function"):
        shape = _calls(syntax, tools, parallel, json_grammar)
    elif fmt == "generic":
        response = {"type": "sequence", "elements": [
            {"type": "const_string", "value": '{"response": '},
            {"type": "grammar", "grammar": json_grammar(_STRING_SCHEMA)},
            {"type": "const_string", "value": "}"}]}
        shape = {"type": "or", "elements": [_calls(syntax, tools, parallel, json_grammar), response]}
    elif fmt == "mistral":
        inner = Syntax(syntax.call_open, syntax.call_close, syntax.separator)
        tag = {"type": "tag", "begin": syntax.before, "content": _calls(inner, tools, parallel, json_grammar),
               "end": syntax.after}
        shape = {"type": "triggered_tags", "triggers": [syntax.trigger], "tags": [tag], "at_least_one": False,
                 "stop_after_first": True}
    else:
        shape = {"type": "triggered_tags", "triggers": [syntax.trigger], "tags": _tags(syntax, tools, json_grammar),
                 "at_least_one": False, "stop_after_first": not parallel}
    return {"type": "structural_tag", "format": shape}


def call_grammar(fmt: str, tools: list[ToolSpec], choice: str, parallel: bool) -> str:
    """The EBNF grammar of the reply ("" when it is free); raises ValueError with xgrammar's reason."""
    import xgrammar as xgr

    from genserve.services.text.engine.grammar import clean_error

    try:
        tag = structural_tag(fmt, tools, choice, parallel)
        return "" if tag is None else str(xgr.Grammar.from_structural_tag(json.dumps(tag)))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(clean_error(exc)) from None


def check_schema(parameters: dict[str, Any]) -> None:
    """Raises ValueError with xgrammar's reason (no C++ source location) when it cannot turn `parameters` into a
    grammar."""
    from genserve.services.text.engine.grammar import clean_error, json_grammar

    try:
        json_grammar(json.dumps(parameters))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(clean_error(exc)) from None
