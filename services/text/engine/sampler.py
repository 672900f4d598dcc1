"""Turning next-token logits into tokens, every row with its own options and its own seeded ``torch.Generator`` (the
same seed gives the same tokens whatever else shares the batch).

Order of operations (as in vLLM/HF): the grammar mask of a structured request (-inf on every token its grammar
forbids next) -> penalties -> greedy argmax, or temperature -> top-k -> top-p
-> min-p -> inverse-CDF draw with one uniform from the request's generator. Logprobs are those of the unmodified
model distribution ``log_softmax(logits)``.

``sample_batch`` runs on the device the logits live on: the filters work on all rows at once, each row with its own
parameters, and the uniforms come from the requests' CPU generators (one number per sampled row), so the draw of a
row depends only on its own logits and generator. Grammar masks are packed bitmasks filled on the host (32 tokens
per int32 word) and unpacked on the device. Only the chosen ids (and the logprobs asked for) come back to the host,
in one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Protocol

import torch

from genserve.services.text.engine.grammar import apply_bitmask, bitmask_words
from genserve.services.text.engine.params import SamplingParams, TokenLogprob
from genserve.shared.seeds import resolve_seed


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator per request; an unseeded one draws its seed the one way (shared/seeds.py)."""
    return torch.Generator().manual_seed(resolve_seed(seed))


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """``penalize_batch`` of one row: ``logits`` (V,), on any device."""
    return penalize_batch(logits[None], [params], [prompt_ids], [output_ids])[0]


def penalize_batch(logits: torch.Tensor, params: Sequence[SamplingParams], prompt_ids: Sequence[list[int]],
                   output_ids: Sequence[list[int]]) -> torch.Tensor:
    """Repetition penalty (Keskar et al. 2019, CTRL: divide positive / multiply negative logits of every seen
    token, prompt included) then presence/frequency penalties (OpenAI: ``-presence*[count>0] - frequency*count``
    over generated tokens only), each row (R, V) with its own ``params``, on the logits' device.

    A decode step runs this for every penalised row, over contexts of thousands of tokens: so no Python set or sort
    of them; the rows' seen and generated ids go to the device in one tensor and are marked and counted there."""
    rows = list(zip(params, prompt_ids, output_ids, strict=True))
    seen = [p + o if q.repetition_penalty != 1 else [] for q, p, o in rows]
    generated = [o if q.presence_penalty or q.frequency_penalty else [] for q, _, o in rows]
    lists = seen + generated
    host = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(lists)) % len(params), torch.tensor([len(x) for x in lists]))
    ids, owner = torch.stack((host, owner)).to(logits.device)  # (2, n): ids, their rows
    n_seen = sum(map(len, seen))
    marked = torch.zeros_like(logits, dtype=torch.bool).index_put_((owner[:n_seen], ids[:n_seen]),
                                                                    torch.ones((), dtype=torch.bool))
    counts = torch.zeros_like(logits).index_put_((owner[n_seen:], ids[n_seen:]), torch.ones((), dtype=logits.dtype),
                                                 accumulate=True)
    rep, presence, frequency = torch.tensor(
        [[q.repetition_penalty, q.presence_penalty, q.frequency_penalty] for q in params], dtype=logits.dtype
    ).to(logits.device).T[..., None]  # each (R, 1)
    logits = torch.where(marked, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - (frequency * counts + presence * (counts > 0).to(logits))


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]  # (R, 1)


def filter_logits_batch(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p (nucleus; Holtzman et al. 2020) and min-p masks, each row (R, V) with its own
    ``params`` (temperature > 0). Filtered-out logits become -inf."""
    logits = logits / _column([p.temperature for p in params], logits)
    ks = [p.top_k if 0 < p.top_k < logits.shape[-1] else 0 for p in params]
    if any(ks):
        # Keep every logit >= the k-th largest (ties at the boundary stay, as torch.topk's threshold does).
        k_max = max(ks)
        top = torch.topk(logits, k_max, dim=-1).values  # (R, k_max)
        kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=logits.device)[:, None])
        kth = torch.where(_column([float(k > 0) for k in ks], logits) > 0, kth, torch.full_like(kth, float("-inf")))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1 for p in params):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top token always stays).
        drop = (probs.cumsum(-1) - probs) >= _column([p.top_p for p in params], probs)
        drop &= _column([float(p.top_p < 1) for p in params], probs) > 0
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(-1)
        floor = _column([p.min_p for p in params], probs) * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def draw_batch(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row r takes the first token whose cumulative probability exceeds ``uniforms[r]`` of the
    row's mass (float64 throughout). logits (R, V), uniforms (R,) in [0, 1) -> token ids (R,)."""
    probs = logits.softmax(-1, dtype=torch.float64)
    cdf = probs.cumsum(-1)
    target = uniforms.to(cdf)[:, None] * probs.sum(-1, keepdim=True)
    idx = torch.searchsorted(cdf, target).clamp_(max=probs.shape[-1] - 1)  # (R, 1)
    # searchsorted can land on a zero-probability slot at the very top of the CDF: step back to the last token
    # with mass at or before it.
    positive = torch.where(probs > 0, torch.arange(probs.shape[-1], device=probs.device), -1)
    last_positive = positive.cummax(-1).values
    return last_positive.gather(1, idx)[:, 0]


def argmax(logits: torch.Tensor) -> int:
    """The first index of the largest logit (V,). On the CPU through numpy, whose SIMD argmax takes ~3 µs on a
    32k vocabulary row against ~30 µs for torch's, and greedy decoding takes one per token (same tie and NaN
    rules: the first maximum, a NaN counting as the maximum)."""
    return int(logits.numpy().argmax()) if logits.device.type == "cpu" else int(logits.argmax().item())


class TokenMask(Protocol):
    """A structured request's grammar (engine/grammar.py ``Grammar``): writes the tokens allowed next."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None: ...

    def fill_along(self, drafts: list[int], bitmask: torch.Tensor) -> None: ...


class SampleRow(Protocol):
    """What sampling one row needs from its request (an engine ``Sequence`` is one): options, generator, the
    tokens seen so far (for penalties) and its grammar, if any."""

    params: SamplingParams
    generator: torch.Generator
    prompt_ids: list[int]
    output_ids: list[int]
    grammar: TokenMask | None


def mask_grammar_rows(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """``logits`` (R, V) with each structured row's forbidden tokens at -inf (the others untouched)."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return logits
    bitmask = torch.empty((len(constrained), bitmask_words(logits.shape[-1])), dtype=torch.int32)
    for j, i in enumerate(constrained):
        rows[i].grammar.fill(bitmask, j)
    index = torch.tensor(constrained, device=logits.device)
    return logits.index_copy(0, index, apply_bitmask(logits[index], bitmask))


def sample_batch(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[tuple[int, TokenLogprob | None]]:
    """The next token of every row of ``logits`` (R, V) and its logprob entry when asked for, computed where the
    logits live. Plain greedy rows on the CPU take numpy's argmax row by row (the decode hot path). Logprobs are
    those of the model (before the grammar mask and penalties)."""
    raw = logits.float()
    if raw.device.type == "cpu" and all(r.params.greedy and not r.params.has_penalties and not r.params.logprobs
                                        and r.grammar is None for r in rows):
        return [(argmax(raw[i]), None) for i in range(len(rows))]
    x = mask_grammar_rows(raw, rows)
    penalised = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if penalised:
        index = torch.tensor(penalised, device=x.device)
        picked = [rows[i] for i in penalised]
        x = x.index_copy(0, index, penalize_batch(x[index], [r.params for r in picked], [r.prompt_ids for r in picked],
                                                  [r.output_ids for r in picked]))
    tokens = x.argmax(-1)  # (R,): the greedy rows' answer; sampled rows are overwritten below
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        index = torch.tensor(sampled, device=x.device)
        uniforms = torch.cat([torch.rand((1,), generator=rows[i].generator, dtype=torch.float64) for i in sampled])
        filtered = filter_logits_batch(x[index], [rows[i].params for i in sampled])
        tokens = tokens.index_copy(0, index, draw_batch(filtered, uniforms.to(x.device, non_blocking=True)))
    wants = [i for i, r in enumerate(rows) if r.params.logprobs]
    if not wants:
        return [(t, None) for t in tokens.tolist()]
    index = torch.tensor(wants, device=x.device)
    logp = raw[index].log_softmax(-1)  # (W, V)
    chosen = logp.gather(1, tokens[index][:, None])[:, 0]
    n_top = max(rows[i].params.logprobs for i in wants)
    top_values, top_ids = torch.topk(logp, n_top, dim=-1)
    # One device-to-host copy for everything that leaves the device this step.
    host = torch.cat([tokens.double(), chosen.double(), top_values.double().flatten(), top_ids.double().flatten()])
    host = host.cpu()
    n_rows = len(rows)
    ids = host[:n_rows].long().tolist()
    chosen_h = host[n_rows:n_rows + len(wants)].tolist()
    tv = host[n_rows + len(wants):n_rows + len(wants) * (1 + n_top)].view(len(wants), n_top).tolist()
    ti = host[n_rows + len(wants) * (1 + n_top):].long().view(len(wants), n_top).tolist()
    out: list[tuple[int, TokenLogprob | None]] = [(t, None) for t in ids]
    for j, i in enumerate(wants):
        k = rows[i].params.logprobs
        out[i] = (ids[i], TokenLogprob(ids[i], chosen_h[j], tuple(zip(ti[j][:k], tv[j][:k], strict=True))))
    return out
