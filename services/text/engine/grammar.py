"""Structured outputs with xgrammar (Dong et al. 2024), the grammar engine vLLM and SGLang use: a request's JSON
Schema or regular expression is compiled once against the tokenizer's vocabulary; every step its matcher writes
the tokens the grammar allows next into a packed bitmask (32 tokens per int32 word), which the sampler applies to
the logits on their device; every accepted token advances the matcher.

A grammar is done when it accepted a stop token, or when it is complete and nothing but a stop token could follow
(the request then ends at once, with finish_reason ``stop``, without spending a step on the stop token). A model
without stop tokens ends at the first point where the output is complete. A grammar still incomplete at
``max_tokens`` ends with ``length`` like any request: its output is a prefix of a valid one.

xgrammar is imported on first use: it loads in seconds (it imports transformers), and a server that never sees a
structured request never pays for it.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import torch

from genserve.services.text.engine.params import InvalidGrammar, InvalidJsonSchema, InvalidRegex, SamplingParams

BITS = 32  # tokens per bitmask word
# A compiled grammar's token-mask cache can grow large for big schemas; xgrammar evicts past this many bytes.
CACHE_LIMIT_BYTES = 256 * 2**20
# xgrammar 0.2 writes the characters of a length-bounded JSON string (minLength/maxLength) as this class, which
# admits raw control characters that JSON forbids inside strings (RFC 8259 §7); its unbounded strings exclude them.
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"
# xgrammar's C++ errors begin with a timestamp and a source location, which a client must never see.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // BITS)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` (R, V) with every token whose bit is 0 in ``bitmask`` (R, ceil(V/32)) int32 set to -inf, computed
    on the logits' device (bit ``t % 32`` of word ``t // 32`` is token ``t``)."""
    shifts = torch.arange(BITS, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.to(logits.device, non_blocking=True)[:, :, None] >> shifts) & 1).flatten(1)  # (R, W*32)
    return logits.masked_fill(allowed[:, : logits.shape[-1]] == 0, float("-inf"))


def json_grammar(schema: str) -> str:
    """The EBNF grammar of compact JSON (no free whitespace, which a sampled model could emit without end)
    satisfying ``schema``, with bounded strings kept free of raw control characters."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":")))
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def clean_error(exc: Exception) -> str:
    """xgrammar's reason without the C++ timestamp and source location."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", message)


class Grammar:
    """One request's grammar state: which tokens may come next, advanced by each token the request accepts."""

    def __init__(self, compiled: Any, stop_ids: frozenset[int], vocab_size: int):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=not stop_ids)
        self._stop = torch.tensor(sorted(stop_ids), dtype=torch.long)
        self._words = bitmask_words(vocab_size)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of a CPU int32 bitmask."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not allow it (the state is then unchanged)."""
        return self._matcher.accept_token(token)

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that spell the text the grammar forces next (jump-forward decoding, SGLang,
        Zheng et al. 2024): the longest vocabulary tokens matching it, not the one the model would write last when a
        longer token could extend it; [] where the next character is the model's choice. The state is unchanged."""
        return self._matcher.find_jump_forward_tokens()[:limit] if limit > 0 else []

    def allowed_prefix(self, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` the grammar accepts from here, token by token; the state is unchanged."""
        n = 0
        while n < len(drafts) and self._matcher.accept_token(drafts[n]):
            n += 1
        if n:
            self._matcher.rollback(n)
        return drafts[:n]

    def fill_along(self, drafts: list[int], bitmask: torch.Tensor) -> None:
        """Rows 0..k of ``bitmask`` (k = len(drafts)): the tokens allowed after the newest token and after each
        draft in turn (the masks a verify pass needs, engine/speculative.py). ``drafts`` must be allowed (as
        ``allowed_prefix`` returns them); the state is unchanged."""
        accepted = 0
        try:
            for j, token in enumerate(drafts):
                self._matcher.fill_next_token_bitmask(bitmask, j)
                if not self._matcher.accept_token(token):
                    raise ValueError(f"draft {j} ({token}) is not allowed by the grammar")
                accepted += 1
            self._matcher.fill_next_token_bitmask(bitmask, len(drafts))
        finally:
            if accepted:
                self._matcher.rollback(accepted)

    @property
    def done(self) -> bool:
        """The output is complete: a stop token was accepted, or only a stop token may follow."""
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        bits = torch.zeros((1, self._words), dtype=torch.int32)
        self.fill(bits, 0)
        allowed = ((bits[0, :, None] >> torch.arange(BITS, dtype=torch.int32)) & 1).flatten()
        allowed[self._stop] = 0
        return not bool(allowed.any())


class GrammarCompiler:
    """Compiles ``json_schema`` / ``regex`` against one tokenizer (its vocabulary, byte encoding and stop tokens),
    built on first use; xgrammar caches compiled grammars, so a repeated schema compiles once."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: frozenset[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                backend = self._tokenizer.backend  # a tokenizers.Tokenizer
                encoded = [""] * self.vocab_size
                for text, i in backend.get_vocab(with_added_tokens=True).items():
                    if i < self.vocab_size:
                        encoded[i] = text
                meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())  # vocab type, prefix space
                info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=self.vocab_size,
                                         stop_token_ids=sorted(self.stop_ids),
                                         add_prefix_space=meta["add_prefix_space"])
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def warm_up(self) -> None:
        """Import xgrammar and index the vocabulary now (seconds), so the first structured request does not wait."""
        self._get()

    def compile(self, params: SamplingParams) -> Grammar | None:
        """A fresh matcher for ``params``' grammar, None when it has none; raises InvalidJsonSchema / InvalidRegex /
        InvalidGrammar with xgrammar's reason."""
        if params.json_schema:
            try:
                compiled = self._get().compile_grammar(json_grammar(params.json_schema))
            except (RuntimeError, ValueError, TypeError) as exc:
                raise InvalidJsonSchema(clean_error(exc)) from None
        elif params.regex:
            try:
                compiled = self._get().compile_regex(params.regex)
            except (RuntimeError, ValueError, TypeError) as exc:
                raise InvalidRegex(clean_error(exc)) from None
        elif params.grammar:
            try:
                compiled = self._get().compile_grammar(params.grammar)
            except (RuntimeError, ValueError, TypeError) as exc:
                raise InvalidGrammar(clean_error(exc)) from None
        else:
            return None
        return Grammar(compiled, self.stop_ids, self.vocab_size)
