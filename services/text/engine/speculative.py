"""Exact speculative decoding with n-gram (prompt lookup) drafts.

A proposer drafts up to k tokens for a running sequence; the engine scores the sequence's newest token and the k
drafts in one forward pass as k + 1 decode rows sharing the sequence's block table, row j with context length
``start + 1 + j`` (engine/batch.py: every row's K/V is written before any row attends, so the rows attend causally;
the CPU runner's fused step takes them like any decode rows), keeping the next-token logits of every position,
and keeps the longest prefix the target model accepts plus one token of its own. One forward pass over k + 1
tokens reads the weights once, like one decode step, so every accepted draft is nearly free where decoding is
bound by the weight stream.

* Proposer (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` proposer, llama.cpp's ``lookup``): find the
  latest earlier occurrence of the sequence's last n tokens (n from ``ngram_max`` down to ``ngram_min``) in the
  prompt and the output so far, and propose the tokens that followed it. No extra weights.
* Acceptance (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1;
  Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2): accept a
  draft x with probability min(1, p(x) / q(x)); at the first rejection, emit a token drawn from
  norm(max(0, p - q)); when all k drafts are accepted, emit a bonus token drawn from p at position k + 1. An n-gram
  draft is a point mass, q = δ_x, so x is accepted with probability p(x) and the residual is p with x removed,
  renormalised: the emitted token at each position then has exactly the distribution p, since
  P(x) = p(x)·[x = d] + (1 - p(d))·p(x)[x ≠ d] / (1 - p(d)) = p(x).
* p is the target distribution after every sampling option the request asks for (sampler.py's order: penalties,
  temperature, top-k, top-p, min-p), computed at draft position j as if drafts 0..j-1 had been emitted (the
  penalties count them); greedy requests accept while the draft equals the argmax, which makes their output
  token-identical to decoding without speculation.

Grammar-constrained requests are not speculated: their next-token mask at draft position j would need the grammar
matcher advanced through drafts 0..j-1 and rolled back on rejection, which this first version does not do; they
decode one token per step as before. A seeded request draws its uniforms from its own generator only, so its
output does not depend on the rest of the batch; it differs from the same seed without speculation (the draw
consumes the generator differently), and a sequence may switch between speculating and not when the batch crosses
``max_batch``.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Literal

import torch

from genserve.services.text.engine.params import TokenLogprob
from genserve.services.text.engine.sampler import SampleRow, filter_logits_batch, penalize_batch

# A sequence whose drafts were all rejected n verify passes in a row skips speculation for min(2^n, this) steps.
MAX_BACKOFF = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates: the proposer, how many tokens it drafts per step, the n-gram lengths it matches,
    and the batch size (decoding sequences in one step) above which speculation switches off, since a large batch
    is bound by compute, not by the weight stream, and pays for every rejected draft."""

    method: Literal["ngram"] = "ngram"
    num_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    max_batch: int = 8

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"method must be 'ngram', got {self.method!r}")
        for name in ("num_tokens", "ngram_min", "ngram_max", "max_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")


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


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from unnormalised non-negative rows: row r takes the first token whose cumulative mass
    exceeds ``uniforms[r]`` of the row's total. probs (R, V) float64, uniforms (R,) in [0, 1) -> ids (R,)."""
    cdf = probs.cumsum(-1)
    target = uniforms.to(cdf)[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)  # (R, 1)
    # Rounding can land on a zero-mass slot at the top of the CDF: step back to the last token with mass.
    positive = torch.where(probs > 0, torch.arange(probs.shape[-1], device=probs.device), -1)
    return positive.cummax(-1).values.gather(1, idx)[:, 0]


def accept_point_mass(probs: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor,
                      u_residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule of Leviathan et al. 2023 / Chen et al. 2023 for a draft distribution q = δ_draft, row by
    row: accept the draft when u < min(1, p(d)/q(d)) = p(d); otherwise the token is drawn from
    norm(max(0, p - q)) = p with the draft's mass removed. probs (R, V) target probabilities (float64), drafts (R,),
    two uniforms per row -> (accepted (R,) bool, token (R,): the draft where accepted, the residual draw elsewhere)."""
    p_draft = probs.gather(1, drafts[:, None])[:, 0]
    accepted = u_accept.to(p_draft) < p_draft
    residual = probs.scatter(1, drafts[:, None], 0.0)  # max(0, p - δ_d)
    corrected = sample_from(residual, u_residual)
    return accepted, torch.where(accepted, drafts, corrected)


def target_logits(raw: torch.Tensor, row: SampleRow, drafts: list[int]) -> torch.Tensor:
    """The logits sampling sees at each of the k + 1 positions (k = len(drafts)), penalties applied as if drafts
    0..j-1 were already emitted at position j. raw (k+1, V) float -> (k+1, V)."""
    if not row.params.has_penalties:
        return raw
    positions = range(raw.shape[0])
    return penalize_batch(raw, [row.params for _ in positions], [row.prompt_ids for _ in positions],
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
    Sampled: ``accept_point_mass`` with 2k + 1 uniforms from the request's own generator (k to accept, k + 1 to
    draw the corrected or bonus token), so a seeded request ignores the rest of the batch."""
    k = len(drafts)
    x = target_logits(raw.float(), row, drafts)
    params = row.params
    if params.greedy:
        best = x.argmax(-1).tolist()
        accepted = next((j for j in range(k) if drafts[j] != best[j]), k)
        tokens = drafts[:accepted] + [best[accepted]]
    else:
        u = torch.rand((2 * k + 1,), generator=row.generator, dtype=torch.float64)
        probs = filter_logits_batch(x, [params] * (k + 1)).softmax(-1, dtype=torch.float64)  # (k+1, V)
        draft_ids = torch.tensor(drafts, dtype=torch.long, device=probs.device)
        ok, picked = accept_point_mass(probs[:k], draft_ids, u[:k], u[k:2 * k])
        ok_list = ok.tolist()
        accepted = next((j for j in range(k) if not ok_list[j]), k)
        if accepted < k:
            last = int(picked[accepted])
        else:
            last = int(sample_from(probs[k:], u[2 * k:])[0])
        tokens = drafts[:accepted] + [last]
    logprobs = None
    if params.logprobs:
        logp = raw[: len(tokens)].float().log_softmax(-1)  # the model's own distribution, as sampler.py reports
        top_values, top_ids = torch.topk(logp, params.logprobs, dim=-1)
        chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
        tv, ti = top_values.tolist(), top_ids.tolist()
        logprobs = [TokenLogprob(t, chosen[j], tuple(zip(ti[j], tv[j], strict=True))) for j, t in enumerate(tokens)]
    return Verdict(tokens, accepted, logprobs)
