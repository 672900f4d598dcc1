"""What a request asks for (``SamplingParams``) and what the engine streams back (``Delta``), plus the request-level
errors the serving layer maps to status codes (services/text/schema.py). Torch-free, like the wire schema that
imports it."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Alternatives per token, as OpenAI's completions API allows; the gRPC and HTTP limit too (services/text/schema.py).
MAX_LOGPROBS = 5
# Logits are divided by the temperature and (when positive) by the repetition penalty: below these the float32
# quotient overflows (a temperature of 1.4e-45 turned every logit into inf and the sampled id into garbage), so a
# positive value under the floor is refused, as vLLM warns about temperatures under 0.01.
MIN_TEMPERATURE = 0.01
MIN_REPETITION_PENALTY = 0.01


class PromptTooLong(ValueError):
    """The prompt plus ``max_tokens`` cannot fit the model's context."""


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the caller should retry later."""


class AdapterNotFound(LookupError):
    """A request or an unload names a LoRA adapter that is not loaded (NOT_FOUND, naming it)."""


class AdapterCapacityExceeded(RuntimeError):
    """A LoRA adapter cannot be held: every adapter in memory (``max_cpu_loras``) is in use by a queued request
    (RESOURCE_EXHAUSTED)."""


class InvalidAdapter(ValueError):
    """A LoRA adapter folder is refused: outside the adapter root, corrupt, or not made for this base model."""


class InvalidJsonSchema(ValueError):
    """``json_schema`` is not a JSON Schema the grammar engine can compile."""


class InvalidGrammar(ValueError):
    """``grammar`` (the EBNF of a request's tool calls, services/text/tools/formats.py) does not compile."""


class InvalidRegex(ValueError):
    """``regex`` is not a regular expression the grammar engine can compile."""


class NoChatTemplate(RuntimeError):
    """The model ships no chat template, so `messages` cannot be formatted (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding options. ``temperature=0`` means greedy; ``top_k=0`` and ``top_p=1`` disable those
    filters; penalties follow the CTRL paper (repetition) and the OpenAI API (presence/frequency). ``json_schema``
    or ``regex`` or ``grammar`` (EBNF; at most one of the three) constrains the output to a grammar
    (engine/grammar.py). ``adapter``: the name of a loaded LoRA adapter to run the request with ("" for the base
    model; services/text/engine/adapters.py). ``speculative=False``: the request is never drafted for, where the
    engine speculates (engine/speculative.py); its output is the same either way, only its speed differs."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int = 0
    json_schema: str = ""
    regex: str = ""
    grammar: str = ""
    adapter: str = ""
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        _check(_finite(self.temperature) and (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE),
               "temperature", f"must be 0 (greedy) or >= {MIN_TEMPERATURE}")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be an integer >= 0")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty >= MIN_REPETITION_PENALTY,
               "repetition_penalty", f"must be >= {MIN_REPETITION_PENALTY}")
        _check(_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
               "must be in [-2, 2]")
        _check(_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
               "must be in [-2, 2]")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), "seed",
               "must be None or an integer in [0, 2**63)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must hold non-empty strings")
        _check(isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               f"must be an integer in [0, {MAX_LOGPROBS}]")
        _check(isinstance(self.json_schema, str) and isinstance(self.regex, str), "json_schema",
               "and regex must be strings")
        _check(not (self.json_schema and self.regex), "regex", "give at most one of json_schema and regex")
        _check(isinstance(self.grammar, str) and not (self.grammar and (self.json_schema or self.regex)), "grammar",
               "must be a string, and not given with json_schema or regex")
        _check(isinstance(self.adapter, str), "adapter", "must be a string (a loaded adapter's name, or empty)")
        _check(isinstance(self.speculative, bool), "speculative", "must be a boolean")

    @property
    def structured(self) -> bool:
        return bool(self.json_schema or self.regex or self.grammar)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _finite(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def _check(ok: bool, name: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}")


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a chosen token under the model, and the ``top`` most likely (token_id, logprob) pairs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Delta:
    """What one engine step produced for one request: new text (held back while it could still become a stop
    string or an incomplete UTF-8 character), the new token ids, and ``finish_reason`` on the last delta:
    ``eos`` | ``length`` | ``stop`` | ``context_length`` | ``cancelled``."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()

    def then(self, later: Delta) -> Delta:
        """This delta followed by ``later`` as one: what a consumer that fell behind receives instead of both."""
        return Delta(self.text + later.text, self.token_ids + later.token_ids, later.finish_reason,
                     self.logprobs + later.logprobs)
