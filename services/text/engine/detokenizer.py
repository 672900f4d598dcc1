"""Incremental detokenisation for streaming, and stop strings that never leak into the output.

Decoding one token at a time is wrong for byte-level BPE: a multi-byte UTF-8 character can span tokens, and
some tokenizers only place spaces correctly with left context. ``IncrementalDetokenizer`` decodes a short window
``ids[prefix:]`` and emits the text past ``ids[prefix:read]``, waiting while the tail is an incomplete character
(decoded as U+FFFD). ``StopChecker`` holds back the last ``max(len(stop)) - 1`` characters so a stop string split
across tokens is cut before any part of it is streamed.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"
# Tokens of left context kept when decoding a window (enough for spaces and merged bytes to come out right).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing token list into exactly the new text, never splitting a UTF-8 character."""

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: list[int]):
        self._decode = decode
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if after.endswith(REPLACEMENT) or len(after) <= len(before):
            return ""
        new_text = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        return new_text


class StopChecker:
    """Accumulates generated text, finds the first stop string, and says how much text is safe to stream."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def add(self, new_text: str) -> bool:
        """Append ``new_text``; return True (and truncate the text before it) when a stop string appears."""
        start = max(0, len(self.text) - self._hold)
        self.text += new_text
        hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return True
        return False

    def take(self, final: bool) -> str:
        """The text that can be streamed now: everything when ``final``, else all but the held-back tail."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self._hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
