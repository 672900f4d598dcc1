"""Reading a model's output back into reasoning, content and tool calls, for each tool-call format
(services/text/tools/formats.py), whole or while it streams.

One function, `parse`, reads the text so far. A stream calls it again after every delta and sends what changed
(`StreamParser`): a reply is at most 1024 tokens, so reparsing costs microseconds, and the unary answer and the
assembled stream come from the same code, so they agree. While a stream is unfinished, `parse` holds back any tail
that could still become markup (`<tool_c`, `</thi`), so nothing it has sent must be taken back.

A call's `arguments` are the model's own text of the JSON value, not a re-serialisation: what a stream sends in
pieces is exactly the unary answer's string.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_OPEN = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
# The key that holds a call's arguments, per format (Llama 3.x templates write "parameters").
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class CallPart:
    """One call as far as the text goes: `name` once its string is complete, `arguments` the value's text so far,
    `complete` once the value is closed."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: list[CallPart] = field(default_factory=list)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could be the start of one of `markers` (kept back while streaming)."""
    for size in range(min(len(text), max(map(len, markers))), 0, -1):
        if any(m.startswith(text[-size:]) and m != text[-size:] for m in markers):
            return size
    return 0


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


@dataclass
class ObjectScan:
    """The top-level fields of a JSON object in (partial) text: key -> (value start, value end or None)."""

    fields: dict[str, tuple[int, int | None]]
    end: int | None  # one past the closing brace, None while open


def scan_object(text: str, start: int = 0) -> ObjectScan | None:
    """Scans the JSON object that begins at `start` (after whitespace); None when something else begins there."""
    i = _skip_ws(text, start)
    if i >= len(text) or text[i] != "{":
        return None
    fields: dict[str, tuple[int, int | None]] = {}
    depth, in_string, escaped = 0, False, False
    state, key, mark = "key", "", 0  # state at depth 1: key, in_key, colon, value, in_value
    for pos in range(i, len(text)):
        c = text[pos]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 1 and state == "in_key":
                    key, state = _key(text[mark:pos + 1]), "colon"
            continue
        if c in " \t\r\n":
            continue
        if depth == 1 and state == "value":
            fields[key], state = (pos, None), "in_value"
        if c == '"':
            in_string = True
            if depth == 1 and state == "key":
                mark, state = pos, "in_key"
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                if state == "in_value":
                    fields[key] = (fields[key][0], _value_end(text, pos))
                return ObjectScan(fields, pos + 1)
        elif depth == 1 and c == ":" and state == "colon":
            state = "value"
        elif depth == 1 and c == "," and state == "in_value":
            fields[key], state = (fields[key][0], _value_end(text, pos)), "key"
    return ObjectScan(fields, None)


def _key(quoted: str) -> str:
    """A key's text; one that is no valid JSON string (a raw control character) keeps its quotes, so it matches no
    field the parsers look for."""
    try:
        return json.loads(quoted)
    except ValueError:
        return quoted


def _value_end(text: str, delimiter: int) -> int:
    end = delimiter
    while text[end - 1] in " \t\r\n":
        end -= 1
    return end


def _string_value(text: str, span: tuple[int, int | None] | None) -> str | None:
    """A complete JSON string field's value, None while it is unfinished or not a string."""
    if span is None or span[1] is None or text[span[0]] != '"':
        return None
    try:
        value = json.loads(text[span[0]:span[1]])
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def partial_string(text: str, span: tuple[int, int | None]) -> str:
    """A JSON string field's value so far (an unfinished escape is left out until it completes)."""
    start, end = span
    if end is not None:
        value = _string_value(text, span)
        return value if value is not None else ""
    raw = text[start + 1:]
    for cut in range(len(raw), max(-1, len(raw) - 7), -1):  # an escape is at most 6 characters (\uXXXX)
        try:
            return json.loads(f'"{raw[:cut]}"')
        except ValueError:
            continue
    return ""


def call_at(text: str, start: int) -> tuple[CallPart, int | None] | None:
    """The call object at `start`: `{"name": ..., "arguments" | "parameters": ...}`, and where it ends."""
    scan = scan_object(text, start)
    if scan is None:
        return None
    part = CallPart(name=_string_value(text, scan.fields.get("name")))
    span = next((scan.fields[k] for k in ARGUMENT_KEYS if k in scan.fields), None)
    if span is not None:
        value_end = span[1] if span[1] is not None else len(text)
        part.arguments = text[span[0]:value_end]
        part.complete = span[1] is not None and scan.end is not None
    elif scan.end is not None:  # a call without arguments
        part.arguments, part.complete = "{}", True
    return part, scan.end


def calls_in_list(text: str, start: int) -> list[CallPart]:
    """The call objects of the JSON list that begins at `start` (after whitespace), as far as they go."""
    i = _skip_ws(text, start)
    if i >= len(text) or text[i] != "[":
        return []
    calls, i = [], i + 1
    while True:
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i += 1
            continue
        found = call_at(text, i)
        if found is None:
            return calls
        calls.append(found[0])
        if found[1] is None:
            return calls
        i = found[1]


def split_reasoning(text: str, thinking: bool, final: bool) -> tuple[str, str, bool]:
    """(reasoning, the rest, whether the rest may be read yet). `thinking`: the prompt ended inside a thinking
    section (DeepSeek-R1's and Qwen3's generation prompts may open it), so the output starts in it."""
    stripped = text.lstrip()
    if not thinking:
        if stripped.startswith(THINK_OPEN):
            text, thinking = stripped[len(THINK_OPEN):], True
        elif not final and THINK_OPEN.startswith(stripped):
            return "", "", False  # may still become <think>
    if not thinking:
        return "", text, True
    close = text.find(THINK_CLOSE)
    if close < 0:
        held = 0 if final else _held(text, (THINK_CLOSE,))
        return text[:len(text) - held].strip(), "", final  # trailing space waits: it may precede </think>
    return text[:close].strip(), text[close + len(THINK_CLOSE):].lstrip(), True


def _hermes(text: str, final: bool) -> Parsed:
    out, pos = Parsed(), 0
    while True:
        open_at = text.find(HERMES_OPEN, pos)
        if open_at < 0:
            tail = text[pos:]
            out.content += tail[:len(tail) - (0 if final else _held(tail, (HERMES_OPEN,)))]
            break
        out.content += text[pos:open_at]
        body_at = open_at + len(HERMES_OPEN)
        close_at = text.find(HERMES_CLOSE, body_at)
        body = text[body_at:] if close_at < 0 else text[body_at:close_at]
        found = call_at(body, 0)
        if found is not None:
            out.calls.append(found[0])
        if close_at < 0:
            break
        pos = close_at + len(HERMES_CLOSE)
    if out.calls:
        out.content = out.content.strip()
    return out


def _mistral(text: str, final: bool) -> Parsed:
    open_at = text.find(MISTRAL_OPEN)
    if open_at < 0:
        # The tokenizer's decode drops [TOOL_CALLS] where it is a special token: a reply that is a list of calls.
        calls = calls_in_list(text, 0) if text.lstrip().startswith("[{") else []
        if calls and (not final or all(c.complete for c in calls)):
            return Parsed(calls=calls)
        return Parsed(content=text[:len(text) - (0 if final else _held(text, (MISTRAL_OPEN, "[{")))])
    return Parsed(content=text[:open_at].strip(), calls=calls_in_list(text, open_at + len(MISTRAL_OPEN)))


def _llama3(text: str, final: bool) -> Parsed:
    body = text.lstrip()
    body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        if not final and (not body or PYTHON_TAG.startswith(body)):
            return Parsed()
        return Parsed(content=text)
    calls, i = [], 0
    while (found := call_at(body, i)) is not None:
        calls.append(found[0])
        if found[1] is None:
            break
        i = _skip_ws(body, found[1])
        if body[i:i + 1] == ";":  # several calls are separated by semicolons
            i += 1
    if final and not any(c.name for c in calls):
        return Parsed(content=text)  # a JSON answer, not a call
    return Parsed(calls=calls)


def _generic(text: str, final: bool) -> Parsed:
    scan = scan_object(text, 0)
    if scan is None:
        return Parsed(content=text if final or text.strip() else "")
    if "response" in scan.fields:
        span = scan.fields["response"]
        return Parsed(content=partial_string(text, span) if text[span[0]] == '"' else "")
    if "tool_call" in scan.fields:
        found = call_at(text, scan.fields["tool_call"][0])
        return Parsed(calls=[found[0]] if found else [])
    if "tool_calls" in scan.fields:
        return Parsed(calls=calls_in_list(text, scan.fields["tool_calls"][0]))
    return Parsed(content=text if final else "")


PARSERS = {"hermes": _hermes, "mistral": _mistral, "llama3": _llama3, "generic": _generic}


def parse(text: str, tool_format: str | None, *, reasoning: bool = False, thinking: bool = False,
          final: bool = True) -> Parsed:
    """Split `text` into reasoning (templates with a thinking section), content and calls (`tool_format`, None when
    the request has no tools or tool_choice is "none"). `final`: the text is whole (else a stream's text so far)."""
    think, rest, readable = split_reasoning(text, thinking, final) if reasoning else ("", text, True)
    if not readable:
        return Parsed(reasoning=think)
    if tool_format is None:
        return Parsed(content=rest, reasoning=think)
    out = PARSERS[tool_format](rest, final)
    out.reasoning = think
    if final:  # an unfinished call (cut by max_tokens) is not a call: its text stays in the content
        unfinished = [c for c in out.calls if not (c.complete and c.name)]
        if unfinished:
            out.calls = [c for c in out.calls if c.complete and c.name]
            if not out.calls:
                out.content = out.content or rest
    return out


@dataclass(frozen=True)
class CallDelta:
    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class StreamDelta:
    content: str = ""
    reasoning: str = ""
    calls: tuple[CallDelta, ...] = ()


class StreamParser:
    """Turns a stream's text deltas into content, reasoning and call pieces, as OpenAI streams them: a call's first
    piece carries its index, id and name, later ones more of its arguments."""

    def __init__(self, tool_format: str | None, new_id: Callable[[], str], *, reasoning: bool = False,
                 thinking: bool = False):
        self.tool_format, self.reasoning, self.thinking = tool_format, reasoning, thinking
        self._new_id = new_id
        self.text = ""
        self.sent = Parsed()
        self.ids: list[str] = []
        self.sent_arguments: list[int] = []

    def feed(self, text: str, final: bool = False) -> StreamDelta:
        self.text += text
        now = parse(self.text, self.tool_format, reasoning=self.reasoning, thinking=self.thinking, final=final)
        content = now.content[len(self.sent.content):] if now.content.startswith(self.sent.content) else ""
        reasoning = now.reasoning[len(self.sent.reasoning):] if now.reasoning.startswith(self.sent.reasoning) else ""
        calls = []
        for index, call in enumerate(now.calls):
            if call.name is None:
                break
            if index == len(self.ids):
                self.ids.append(self._new_id())
                self.sent_arguments.append(0)
                calls.append(CallDelta(index, self.ids[index], call.name, call.arguments))
            elif len(call.arguments) > self.sent_arguments[index]:
                calls.append(CallDelta(index, "", "", call.arguments[self.sent_arguments[index]:]))
            self.sent_arguments[index] = max(self.sent_arguments[index], len(call.arguments))
        self.sent = Parsed(content=self.sent.content + content, reasoning=self.sent.reasoning + reasoning)
        return StreamDelta(content, reasoning, tuple(calls))

