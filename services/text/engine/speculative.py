"""Exact speculative decoding with n-gram (prompt lookup) or draft-model drafts, and jump-forward drafts for grammars.

A proposer drafts up to k tokens for a running sequence; the engine scores the sequence's newest token and the k
drafts in one forward pass as k + 1 decode rows sharing the sequence's block table, row j with context length
``start + 1 + j`` (engine/batch.py: every row's K/V is written before any row attends, so the rows attend causally;
the CPU runner's fused step takes them like any decode rows), keeping the next-token logits of every position,
and keeps the longest prefix the target model accepts plus one token of its own. One forward pass over k + 1
tokens reads the weights once, like one decode step, so every accepted draft is nearly free where decoding is
bound by the weight stream.

* Proposers (LLMEngine._propose):
  - n-gram (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` proposer, llama.cpp's ``lookup``): find the
    latest earlier occurrence of the sequence's last n tokens (n from ``ngram_max`` down to ``ngram_min``) in the
    prompt and the output so far, and propose the tokens that followed it. No extra weights.
  - a draft model (Leviathan et al. 2023; vLLM's ``draft_model``): a smaller model with the same tokenizer drafts
    its k greedy tokens, with its own paged KV cache (engine/draft.py).
  - jump-forward (SGLang, Zheng et al. 2024, "SGLang: Efficient Execution of Structured Language Model
    Programs"): for a grammar-constrained request, the tokens spelling the text its grammar forces next (a JSON
    key, the punctuation between values); engine/grammar.py ``Grammar.forced_tokens``. Unlike SGLang, the forced
    tokens are verified like any draft, so a tokenisation the model would not choose costs a rejected slot,
    never a different output.
* Acceptance (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1;
  Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2): accept a
  draft x with probability min(1, p(x) / q(x)); at the first rejection, emit a token drawn from
  norm(max(0, p - q)); when all k drafts are accepted, emit a bonus token drawn from p at position k + 1. Every
  proposer's drafts are point masses, q = δ_x (the draft model's too: its greedy drafts are a deterministic function
  of the context), so x is accepted with probability p(x) and the residual is p with x removed, renormalised: the
  emitted token at each position then has exactly the distribution p, since
  P(x) = p(x)·[x = d] + (1 - p(d))·p(x)[x ≠ d] / (1 - p(d)) = p(x). ``kept_draws`` realises this rule by drawing
  each position's token from p and keeping the draft when the draw equals it, one uniform per emitted token.
* p is the target distribution after every sampling option the request asks for (sampler.py's order: the grammar
  mask, penalties, temperature, top-k, top-p, min-p), computed at draft position j as if drafts 0..j-1 had been
  emitted (the grammar matcher is advanced through them and rolled back, the penalties count them); greedy
  requests accept while the draft equals the argmax.

So the output does not depend on drafting: a greedy request's tokens are those of decoding without drafts, and a
seeded request's too (its i-th token uses the i-th uniform of its own generator, drafted or not), whatever the
batch, the drafts or the step budget were, up to the float rounding of a batch of k + 1 rows against one.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Literal

import torch

from genserve.services.text.engine.grammar import apply_bitmask, bitmask_words
from genserve.services.text.engine.params import TokenLogprob
from genserve.services.text.engine.sampler import SampleRow, draw_batch, filter_logits_batch, penalize_batch

# A sequence whose drafts were all rejected n verify passes in a row skips speculation for min(2^n, this) steps.
MAX_BACKOFF = 16


def next_draft_length(k: int, drafted: int, accepted: int, num_tokens: int) -> int:
    """Adaptive k (the schedule of transformers' assisted generation, "heuristic"): after a pass that accepted all
    ``drafted`` tokens, the next draft may be 2 longer; after a rejection, 1 shorter; within [1, num_tokens]. ``k``:
    the length allowed before the pass."""
    return min(num_tokens, k + 2) if accepted == drafted else max(1, k - 1)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates: the proposer, how many tokens it drafts per step, the n-gram lengths it matches
    (``ngram``), the draft model's checkpoint (``draft``: a HF folder or GGUF file with the target's tokenizer), and
    the batch size (decoding sequences in one step) above which speculation switches off, since a large batch is
    bound by compute, not by the weight stream, and pays for every rejected draft."""

    method: Literal["ngram", "draft"] = "ngram"
    num_tokens: int = 4
    # 2: a one-token match drafts in open-ended text too, where nearly every draft is rejected (docs/benchmarks.md)
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch: int = 8
    draft_model_dir: str = ""

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"method must be 'ngram' or 'draft', got {self.method!r}")
        for name in ("num_tokens", "ngram_min", "ngram_max", "max_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        if self.method == "draft" and not self.draft_model_dir:
            raise ValueError("method 'draft' needs draft_model_dir, the draft model's folder or GGUF file")
        if self.method != "draft" and self.draft_model_dir:
            raise ValueError("draft_model_dir is only read with method 'draft'")


def propose_ngram(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Prompt lookup (Saxena 2023): the up to ``k`` tokens that followed the latest earlier occurrence of the last
    n tokens of ``tokens``, trying n = ``ngram_max`` down to ``ngram_min``; [] when none occurs. The search runs
    over the int32 bytes of the tokens with ``bytes.rfind`` (C speed), keeping only matches on a token boundary."""
    size = len(tokens)
    if k <= 0 or size < 2:
        return []
    data = array("i", tokens).tobytes()
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        needle = data[(size - n) * 4:]
        end = (size - 1) * 4  # a match must end before the last token, so that a token follows it
        pos = data.rfind(needle, 0, end)
        while pos != -1 and pos % 4:
            end = pos + len(needle) - 1
            pos = data.rfind(needle, 0, end)
        if pos != -1:
            start = pos // 4 + n
            return tokens[start:start + k]
    return []


def kept_draws(draws: list[int], drafts: list[int]) -> list[int]:
    """The verify rule on one draw per position: the draws up to and including the first that differs from its
    draft (all k + 1 when every draft matches: the last is the bonus token).

    This is the rule of Leviathan et al. 2023 / Chen et al. 2023 for a point-mass draft q = δ_d: the draft is kept
    with probability p(d) = min(1, p(d)/q(d)), and a rejected position emits a draw from p conditioned on x != d,
    which is norm(max(0, p - q)); so every emitted token is distributed as p."""
    n = next((j for j, d in enumerate(drafts) if draws[j] != d), len(drafts))
    return draws[:n + 1]


def draw_along(filtered: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """The sampled verify pass: a draw at every position of ``filtered`` (k+1, V) logits as ``sample_batch`` draws
    a token (one float64 uniform from ``generator``, ``draw_batch``), cut by ``kept_draws``. The generator moves on
    by one uniform per emitted token only, so the i-th token of a seeded request uses the i-th uniform of its
    generator whether it was drafted or not, and its output is the same as without drafts."""
    gen = generator if generator is not None else torch.default_generator
    state = gen.get_state()
    # n uniforms at once are the next n single draws (CPU generator), so the unused ones can be given back.
    u = torch.rand((filtered.shape[0],), generator=gen, dtype=torch.float64)
    tokens = kept_draws(draw_batch(filtered, u.to(filtered.device)).tolist(), drafts)
    gen.set_state(state)
    torch.rand((len(tokens),), generator=gen, dtype=torch.float64)
    return tokens


def target_logits(raw: torch.Tensor, row: SampleRow, drafts: list[int]) -> torch.Tensor:
    """The logits sampling sees at each of the k + 1 positions (k = len(drafts)), as if drafts 0..j-1 were already
    emitted at position j: the grammar's mask after them, and the penalties counting them. raw (k+1, V) float ->
    (k+1, V)."""
    x = raw
    if row.grammar is not None:
        bitmask = torch.empty((raw.shape[0], bitmask_words(raw.shape[-1])), dtype=torch.int32)
        row.grammar.fill_along(drafts, bitmask)
        x = apply_bitmask(x, bitmask)
    if not row.params.has_penalties:
        return x
    positions = range(raw.shape[0])
    return penalize_batch(x, [row.params for _ in positions], [row.prompt_ids for _ in positions],
                          [row.output_ids + drafts[:j] for j in positions])


@dataclass(frozen=True)
class Verdict:
    """What one verify pass gives a sequence: the tokens to emit (accepted drafts, then the corrected or bonus
    token), how many drafts were accepted, and each emitted token's logprob when the request asks for them."""

    tokens: list[int]
    accepted: int
    logprobs: list[TokenLogprob] | None


def verify(raw: torch.Tensor, row: SampleRow, drafts: list[int]) -> Verdict:
    """Verify ``drafts`` against the target model's logits ``raw`` (k+1, V) (row j: the next-token logits after the
    sequence's newest token and drafts 0..j-1). Greedy: accept while each draft is the argmax, then emit the argmax.
    Sampled: ``draw_along``, one uniform per emitted token from the request's own generator."""
    k = len(drafts)
    x = target_logits(raw.float(), row, drafts)
    params = row.params
    if params.greedy:
        best = x.argmax(-1).tolist()
        accepted = next((j for j in range(k) if drafts[j] != best[j]), k)
        tokens = drafts[:accepted] + [best[accepted]]
    else:
        tokens = draw_along(filter_logits_batch(x, [params] * (k + 1)), drafts, row.generator)
        accepted = len(tokens) - 1
    logprobs = None
    if params.logprobs:
        logp = raw[: len(tokens)].float().log_softmax(-1)  # the model's own distribution, as sampler.py reports
        top_values, top_ids = torch.topk(logp, params.logprobs, dim=-1)
        chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
        tv, ti = top_values.tolist(), top_ids.tolist()
        logprobs = [TokenLogprob(t, chosen[j], tuple(zip(ti[j], tv[j], strict=True))) for j, t in enumerate(tokens)]
    return Verdict(tokens, accepted, logprobs)
