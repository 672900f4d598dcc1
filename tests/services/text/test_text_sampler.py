"""The batched sampler: each row is sampled exactly as it would be alone (its own options and generator), and a
row's token never depends on what else shares the batch."""

from __future__ import annotations

import pytest
import torch

from genserve.services.text.engine.params import SamplingParams
from genserve.services.text.engine.sampler import apply_penalties, make_generator, sample_batch
from genserve.services.text.engine.sequence import Sequence

PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.0, top_k=5, seed=2),
    SamplingParams(temperature=1.3, top_p=0.8, seed=3),
    SamplingParams(temperature=0.9, min_p=0.1, seed=4),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.9, min_p=0.02, seed=5),
    SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(temperature=0.8, repetition_penalty=1.2, logprobs=3, seed=6),
    SamplingParams(temperature=0, logprobs=2),
]


class Row:
    def __init__(self, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]):
        self.params, self.prompt_ids, self.output_ids = params, prompt_ids, output_ids
        self.generator = make_generator(params.seed if params.seed is not None else 0)
        self.grammar = None


class _Single:
    """A row with its own generator, for drawing many times from one distribution."""

    def __init__(self, params: SamplingParams, generator: torch.Generator):
        self.params, self.generator, self.prompt_ids, self.output_ids, self.grammar = params, generator, [], [], None


def _rows(vocab: int) -> list[Row]:
    gen = torch.Generator().manual_seed(9)
    return [Row(p, torch.randint(0, vocab, (7,), generator=gen).tolist(),
                torch.randint(0, vocab, (5,), generator=gen).tolist()) for p in PARAMS]


def _filtered(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row (V,) written out: temperature, then top-k (ties at the k-th value kept), top-p (a token goes when the
    mass strictly before it reaches top_p) and min-p, each on what the previous one left."""
    x = x / params.temperature
    if 0 < params.top_k < x.numel():
        x = torch.where(x >= x.sort(descending=True).values[params.top_k - 1], x, float("-inf"))
    if params.top_p < 1:
        probs = x.softmax(-1).tolist()
        kept, before = set(), 0.0
        for token in sorted(range(x.numel()), key=lambda t: (-probs[t], t)):
            if before >= params.top_p:
                break
            kept.add(token)
            before += probs[token]
        x = torch.tensor([v if t in kept else float("-inf") for t, v in enumerate(x.tolist())])
    if params.min_p > 0:
        probs = x.softmax(-1)
        x = torch.where(probs >= params.min_p * probs.max(), x, float("-inf"))
    return x


def _draw(x: torch.Tensor, generator: torch.Generator) -> int:
    """The first token whose cumulative probability exceeds one uniform from ``generator`` (float64)."""
    u = float(torch.rand((1,), generator=generator, dtype=torch.float64))
    probs = x.double().softmax(-1).tolist()
    total, target = sum(probs), 0.0
    for token, p in enumerate(probs):
        target += p
        if p > 0 and target > u * total:
            return token
    return max(t for t, p in enumerate(probs) if p > 0)


def _row_by_row(logits: torch.Tensor, rows: list[Row]) -> list[int]:
    """The written-out order of operations for one row: penalties, greedy or filters then one inverse-CDF draw."""
    out = []
    for x, r in zip(logits, rows, strict=True):
        if r.params.has_penalties:
            x = apply_penalties(x, r.params, r.prompt_ids, r.output_ids)
        out.append(int(x.argmax()) if r.params.greedy else _draw(_filtered(x, r.params), r.generator))
    return out


def test_engine_sequences_are_sample_rows() -> None:
    fields = {"params", "generator", "prompt_ids", "output_ids"}
    assert fields <= set(Sequence.__dataclass_fields__)


@pytest.mark.parametrize("vocab", [50, 997])
def test_sample_batch_equals_sampling_each_row_alone(vocab: int) -> None:
    logits = torch.randn(len(PARAMS), vocab) * 3
    expected = _row_by_row(logits, _rows(vocab))
    got = sample_batch(logits, _rows(vocab))
    assert [t for t, _ in got] == expected


def test_a_rows_token_does_not_depend_on_its_batch() -> None:
    vocab = 300
    logits = torch.randn(len(PARAMS), vocab) * 2
    together = sample_batch(logits, _rows(vocab))
    for i in range(len(PARAMS)):
        alone = sample_batch(logits[i : i + 1], [_rows(vocab)[i]])[0]
        assert alone[0] == together[i][0]
        if alone[1] is not None:
            assert alone[1].top == together[i][1].top and alone[1].logprob == pytest.approx(together[i][1].logprob)


def test_logprobs_are_those_of_the_unmodified_distribution() -> None:
    logits = torch.randn(len(PARAMS), 64)
    got = sample_batch(logits, _rows(64))
    for i, (token, lp) in enumerate(got):
        if not PARAMS[i].logprobs:
            assert lp is None
            continue
        logp = logits[i].log_softmax(-1)
        assert lp.token_id == token and lp.logprob == pytest.approx(float(logp[token]), abs=1e-6)
        values, ids = logp.topk(PARAMS[i].logprobs)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-6)


def test_the_draw_follows_the_distribution() -> None:
    """Inverse-CDF sampling with the request's generator: frequencies match softmax(logits / T)."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")])
    params = SamplingParams(temperature=0.5)
    g = make_generator(123)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sample_batch(logits[None], [_Single(params, g)])[0][0]] += 1
    expected = (logits / 0.5).softmax(-1)
    assert counts[4] == 0
    assert torch.allclose(counts / 4000, expected, atol=0.025)
