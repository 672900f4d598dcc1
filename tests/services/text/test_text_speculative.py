"""Exact speculative decoding (engine/speculative.py): the n-gram proposer, the acceptance rule's distribution
(chi-square over >= 20,000 draws; Leviathan et al. 2023, Chen et al. 2023), and greedy output token-identical to
decoding without speculation through the engine, alone, in mixed batches, under preemption and on the fused step."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import pytest
import torch
from text_helpers import VOCAB, byte_tokenizer, hf_model, save_hf

from genserve.services.text.engine.engine import EngineConfig, LLMEngine
from genserve.services.text.engine.grammar import apply_bitmask, bitmask_words
from genserve.services.text.engine.params import SamplingParams
from genserve.services.text.engine.sampler import apply_penalties, draw_batch, filter_logits_batch
from genserve.services.text.engine.speculative import (
    SpeculativeConfig,
    draw_along,
    kept_draws,
    next_draft_length,
    propose_ngram,
    target_logits,
)
from genserve.services.text.loader import load_model

DRAWS = 20_000
SPEC = SpeculativeConfig(num_tokens=4, ngram_min=1, ngram_max=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.manual_seed(0)
    return load_model(save_hf(hf_model("llama"), tmp_path_factory.mktemp("llama"), sharded=False))


def engine_for(model, spec: SpeculativeConfig | None, **config) -> LLMEngine:
    return LLMEngine(model, byte_tokenizer(), EngineConfig(**{"block_size": 4, "num_blocks": 256,
                                                              "speculative": spec, **config}))


def repetitive_prompts() -> list[list[int]]:
    """Prompts whose continuations the n-gram proposer can find in them (and one it mostly cannot)."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
    return [base * 3, base[:5] * 4 + [7], torch.randint(0, VOCAB, (9,), generator=gen).tolist(), base[3:] * 2]


# ---- the proposer ---------------------------------------------------------------------------------------------
def test_ngram_proposer_takes_the_latest_longest_match_on_token_boundaries():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3], 2, 1, 3) == [9, 1]  # latest match of [1, 2, 3]
    assert propose_ngram([5, 6, 7, 8, 6, 7], 5, 1, 3) == [8, 6, 7]  # [6, 7] matched; fewer than k follow
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([7, 7], 3, 1, 3) == [7]
    # 256 = bytes (0, 1, 0, 0) and 1 = (1, 0, 0, 0): byte-level matches that straddle tokens must not count.
    assert propose_ngram([256, 0, 5, 1, 0], 2, 2, 2) == []
    assert propose_ngram([1, 0, 5, 1, 0], 2, 2, 2) == [5, 1]
    assert propose_ngram([1, 2, 3, 1, 2, 3], 2, 2, 2) == [1, 2]


# ---- the acceptance rule's distribution -----------------------------------------------------------------------
def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs`` over the bins with mass (the upper regularised
    incomplete gamma function of the statistic); a count in a zero-mass bin gives 0."""
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    n = counts.sum()
    keep = probs > 0
    expected = probs[keep] * n
    assert bool((expected >= 5).all()), "too few draws for the chi-square approximation"
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def pit_p(draws: Iterable[tuple[list[int], torch.Tensor]]) -> float:
    """The chi-square p-value (10 equal bins) that sampled tokens are draws from the distributions they were drawn
    from: ``draws`` pairs each output ``o`` with the (len(o), V) float64 probabilities at its positions. Each token's
    randomised probability integral transform F(x-) + w·p(x), w ~ U(0, 1), is uniform exactly when it is, which pools
    all positions and histories into one test. Every emitted token must have had mass (none outside top-p)."""
    gen = torch.Generator().manual_seed(0)
    pit = []
    for o, probs in draws:
        ids = torch.tensor(o)[:, None]
        mass = probs.gather(1, ids)[:, 0]
        assert bool((mass > 0).all())
        pit.append((probs.cumsum(-1) - probs).gather(1, ids)[:, 0]
                   + torch.rand(len(o), generator=gen, dtype=torch.float64) * mass)
    counts = torch.histc(torch.cat(pit), bins=10, min=0, max=1).double()
    return chi_square_p(counts, torch.full((10,), 0.1, dtype=torch.float64))


def sampling_probs(rows: torch.Tensor, params: SamplingParams, prompt: list[int], o: list[int],
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """What the sampler draws output ``o``'s tokens from, given the model's logits ``rows`` (len(o), V) at their
    positions: penalties counting the tokens before each, a grammar's bitmask, then temperature, top-k/p, min-p."""
    x = torch.stack([apply_penalties(rows[j], params, prompt, o[:j]) for j in range(len(o))])
    if mask is not None:
        x = apply_bitmask(x, mask)
    return filter_logits_batch(x, [params] * len(o)).softmax(-1, dtype=torch.float64)  # (len(o), V)


def target_logits_for(setting: SamplingParams, vocab: int = 12) -> torch.Tensor:
    """One row of random logits after ``setting``'s filters (-inf outside top-k/top-p/min-p): (1, V)."""
    gen = torch.Generator().manual_seed(vocab)
    return filter_logits_batch(1.5 * torch.randn((1, vocab), generator=gen), [setting])


def emitted_counts(filtered: torch.Tensor, drafts: torch.Tensor, rule, seed: int) -> torch.Tensor:
    """The first emitted token of ``DRAWS`` verify passes of one draft each (target ``filtered``), a draw per
    position from ``draw_batch`` as the engine draws, cut by ``rule``."""
    gen = torch.Generator().manual_seed(seed)
    draws = draw_batch(filtered.expand(2 * DRAWS, -1), torch.rand(2 * DRAWS, generator=gen, dtype=torch.float64))
    draws = draws.view(DRAWS, 2).tolist()
    first = [rule(d, [int(x)])[0] for d, x in zip(draws, drafts, strict=True)]
    return torch.bincount(torch.tensor(first), minlength=filtered.shape[-1]).double()


def redraw_on_mismatch(draws, drafts):
    """A plausible-looking wrong rule: on a rejected draft, emit the next position's fresh draw instead of the
    draw that rejected it (which favours the draft: P(d) = p(d) + (1 - p(d)) p(d))."""
    return draws[:2] if draws[0] == drafts[0] else draws[1:2]


SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8),
            SamplingParams(temperature=1.3, top_k=5, min_p=0.05)]


@pytest.mark.parametrize("setting", SETTINGS, ids=["plain", "top_p", "top_k_min_p"])
def test_accepted_and_corrected_tokens_follow_the_target_distribution(setting):
    filtered = target_logits_for(setting)
    probs = filtered[0].softmax(-1, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    # Drafts from a proposer that knows nothing of p: uniform over the vocabulary, zero-mass tokens included; and
    # always the target's most likely token, where acceptance is most frequent.
    drafts = {"uniform": torch.randint(0, probs.numel(), (DRAWS,), generator=gen),
              "argmax": torch.full((DRAWS,), int(probs.argmax()))}
    for i, d in enumerate(drafts.values()):
        assert chi_square_p(emitted_counts(filtered, d, kept_draws, seed=i), probs) > 1e-3
    wrong = emitted_counts(filtered, drafts["argmax"], redraw_on_mismatch, seed=0)
    assert chi_square_p(wrong, probs) < 1e-3


def test_a_seeded_request_draws_the_same_tokens_with_and_without_drafts():
    filtered = target_logits_for(SamplingParams(temperature=1.0), vocab=6).expand(5, -1)
    plain = torch.Generator().manual_seed(3)
    one_by_one = [draw_along(filtered[:1], [], plain)[0] for _ in range(40)]
    drafted, gen = [], torch.Generator().manual_seed(3)
    while len(drafted) < 40:  # drafts of 4 copies of the next token, often right, sometimes wrong
        drafted += draw_along(filtered, [one_by_one[len(drafted)]] * 4, gen)
    assert drafted[:40] == one_by_one


def test_penalties_at_each_draft_position_count_the_drafts_before_it():
    gen = torch.Generator().manual_seed(3)
    raw = torch.randn((3, 16), generator=gen)
    params = SamplingParams(temperature=0.8, repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.3)

    class Row:
        prompt_ids, output_ids, grammar = [1, 2], [3], None

    Row.params = params
    got = target_logits(raw, Row, [4, 4])
    for j, seen in enumerate(([3], [3, 4], [3, 4, 4])):
        assert torch.equal(got[j], apply_penalties(raw[j], params, [1, 2], seen))


def test_the_draft_length_grows_after_full_acceptance_and_shrinks_after_a_rejection():
    assert next_draft_length(2, 2, 2, 4) == 4 and next_draft_length(4, 4, 4, 4) == 4  # +2, capped at num_tokens
    assert next_draft_length(4, 4, 1, 4) == 3 and next_draft_length(1, 1, 0, 4) == 1  # -1, never below 1
    assert next_draft_length(3, 2, 2, 6) == 5  # a short n-gram match fully accepted still counts as full


# ---- through the engine ---------------------------------------------------------------------------------------
def test_greedy_with_speculation_is_token_identical_alone_and_in_mixed_batches(model):
    ps = repetitive_prompts()
    greedy = SamplingParams(max_tokens=40, temperature=0)
    for prompt in ps[:2]:  # alone
        engine = engine_for(model, SPEC)
        assert engine.generate_batch([prompt], greedy) == engine_for(model, None).generate_batch([prompt], greedy)
        assert engine.speculation_stats()["accepted"] > 0
    mixed = [greedy, SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.2, logprobs=2),
             SamplingParams(max_tokens=25, temperature=0.9, seed=5), SamplingParams(max_tokens=7, temperature=0)]
    engine = engine_for(model, SPEC)
    # The seeded sampled request too: one uniform per emitted token, drafted or not (speculative.draw_along).
    assert engine.generate_batch(ps, mixed) == engine_for(model, None).generate_batch(ps, mixed)
    stats = engine.speculation_stats()
    assert 0 < stats["accepted"] < stats["proposed"] == sum(stats["proposed_by_position"])
    assert engine.kv_blocks_free == engine.blocks.num_blocks


def test_speculation_keeps_logprobs_stop_strings_eos_and_preemption(model):
    prompt = repetitive_prompts()[0]
    ref = engine_for(model, None).generate_batch([prompt], SamplingParams(max_tokens=40, temperature=0,
                                                                         logprobs=3))[0]
    engine = engine_for(model, SPEC)
    deltas = []
    engine.add_request("lp", prompt, SamplingParams(max_tokens=40, temperature=0, logprobs=3), deltas.append)
    while engine.has_work():
        engine.step()
    lps = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in lps] == ref[1]
    want = engine_for(model, None)
    want_deltas = []
    want.add_request("lp", prompt, SamplingParams(max_tokens=40, temperature=0, logprobs=3), want_deltas.append)
    while want.has_work():
        want.step()
    for a, b in zip(lps, [lp for d in want_deltas for lp in d.logprobs], strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]
    # A stop string and EOS that land inside an accepted run cut it there.
    text, ids, _ = ref
    stop = text[20:23]
    params = SamplingParams(max_tokens=40, temperature=0, stop=(stop,))
    assert engine_for(model, SPEC).generate_batch([prompt], params) == \
        engine_for(model, None).generate_batch([prompt], params)
    spec_eos, plain_eos = engine_for(model, SPEC), engine_for(model, None)
    spec_eos.eos_ids = plain_eos.eos_ids = frozenset({ids[9]})
    cut = spec_eos.generate_batch([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    assert cut == plain_eos.generate_batch([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    assert cut[2] == "eos" and cut[1] == ids[: ids.index(ids[9]) + 1]
    # 24 blocks of 4 tokens cannot hold four sequences of ~75 tokens: preemption, then recompute.
    ps, greedy = repetitive_prompts(), SamplingParams(max_tokens=40, temperature=0)
    tight = engine_for(model, SPEC, num_blocks=24, max_batched_tokens=24)
    assert tight.generate_batch(ps, greedy) == engine_for(model, None).generate_batch(ps, greedy)
    assert tight.counters().preemptions > 0 and tight.kv_blocks_free == 24


# ---- grammars: jump-forward drafts and drafts under a mask -----------------------------------------------------
JSON_SCHEMA = json.dumps({"type": "object", "properties": {
    "colour": {"enum": ["crimson", "teal"]}, "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "label": {"type": "string", "pattern": "^[a-z]{1,6}$"}}, "required": ["colour", "count", "label"],
    "additionalProperties": False})
REGEX = r"[a-h]{2}-(red|green|blue)-[0-9]{1,3}-done"


def test_grammar_requests_draft_their_forced_text_and_decode_as_without_drafts(model):
    """Jump-forward (the grammar's forced text as drafts) and n-gram drafts cut to the grammar give the tokens of
    decoding without any draft, greedy and seeded, in a batch with an unconstrained request, and under
    preemption; the forced drafts are nearly all accepted (a byte vocabulary spells forced text one way only)."""
    ps = repetitive_prompts()
    params = [SamplingParams(max_tokens=60, temperature=0, json_schema=JSON_SCHEMA),
              SamplingParams(max_tokens=60, temperature=0.9, seed=4, json_schema=JSON_SCHEMA),
              SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, presence_penalty=0.4, seed=5, regex=REGEX),
              SamplingParams(max_tokens=30, temperature=0)]
    ref = engine_for(model, None, max_jump_forward=0).generate_batch(ps, params)
    assert all(reason == "stop" for _, _, reason in ref[:3])
    assert json.loads(ref[0][0])["colour"] in ("crimson", "teal") and re.fullmatch(REGEX, ref[2][0])
    for spec in (None, SPEC):
        engine = engine_for(model, spec)
        assert engine.generate_batch(ps, params) == ref
        stats = engine.speculation_stats()
        assert stats["forced_accepted"] >= 0.9 * stats["forced_proposed"] > 20
        assert engine.kv_blocks_free == engine.blocks.num_blocks
    tight = engine_for(model, SPEC, num_blocks=24, max_batched_tokens=24)
    assert tight.generate_batch(ps, params) == ref
    assert tight.counters().preemptions > 0 and tight.kv_blocks_free == 24


def test_sampled_grammar_requests_with_drafts_follow_the_masked_model(model):
    """The randomised PIT of every token a grammar request samples with jump-forward and n-gram drafts (as in
    test_sampled_speculation_through_the_engine_follows_the_model), against the model's distribution after the
    grammar's mask at that point, penalties, temperature and top-p."""
    prompt = repetitive_prompts()[0]
    params = SamplingParams(max_tokens=40, temperature=1.2, top_p=0.95, presence_penalty=0.5, regex=REGEX)
    n = 64
    engine = engine_for(model, SpeculativeConfig(num_tokens=3, ngram_min=1, ngram_max=2, max_batch=n),
                        num_blocks=n * 24, max_running=n)
    out = [ids for _, ids, _ in engine.generate_batch([prompt] * n, params)]
    assert engine.speculation_stats()["forced_accepted"] > 100

    def probs_of(o: list[int]) -> torch.Tensor:
        with torch.no_grad():
            rows = model(torch.tensor([prompt + o]))[0, len(prompt) - 1:-1]  # (len(o), V)
        mask = torch.empty((len(o), bitmask_words(rows.shape[-1])), dtype=torch.int32)
        engine.grammars.compile(params).fill_along(o[:-1], mask)
        return sampling_probs(rows, params, prompt, o, mask)

    assert pit_p((o, probs_of(o)) for o in out) > 1e-3


class CountingFused:
    """The CPU runner's fused step, recording the rows of every single-step call and the steps of every lookahead."""

    def __init__(self, inner):
        self.inner, self.rows, self.steps = inner, [], []

    def __call__(self, batch, k_caches, v_caches, lora=None):
        self.rows.append(batch.n_decode)
        return self.inner(batch, k_caches, v_caches, lora)

    def greedy(self, batch, steps, k_caches, v_caches, lora=None):
        self.steps.append(steps)
        return self.inner.greedy(batch, steps, k_caches, v_caches, lora)


def test_the_fused_step_scores_the_drafts_and_keeps_its_lookahead(cpu_kernels, model):
    """A verify chunk is k + 1 decode rows of one sequence (engine/batch.py): the fused C step scores them, and
    steps without a draft keep its greedy lookahead."""
    ps = repetitive_prompts()
    engine = engine_for(model, SPEC)
    assert engine.runner.fused is not None
    engine.runner.fused = counting = CountingFused(engine.runner.fused)
    params = SamplingParams(max_tokens=40, temperature=0)
    for prompt in (ps[0], ps[2]):
        assert engine.generate_batch([prompt], params) == engine_for(model, None).generate_batch([prompt], params)
    assert max(counting.rows) == 1 + SPEC.num_tokens and counting.steps
    assert engine.speculation_stats()["accepted"] > 0


def test_sampled_speculation_through_the_engine_follows_the_model(tmp_path):
    """Every token sampled with speculation, drafted or not, is a draw from the model's distribution given the
    tokens before it (penalties, temperature and top-p applied): ``pit_p``."""
    vocab = 16
    torch.manual_seed(1)
    small = load_model(save_hf(hf_model("llama", vocab_size=vocab), tmp_path, sharded=False))
    prompt = list(range(vocab)) * 2  # every token occurs: a one-token n-gram always matches
    params = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3)
    n = 64
    engine = LLMEngine(small, byte_tokenizer(), EngineConfig(
        block_size=16, num_blocks=n * 6, max_running=n, speculative=SpeculativeConfig(
            num_tokens=3, ngram_min=1, ngram_max=2, max_batch=n)))
    out = [ids for _, ids, _ in engine.generate_batch([prompt] * n, params)]
    stats = engine.speculation_stats()
    assert stats["proposed_by_position"][2] > 50 and 0 < stats["accepted"] < stats["proposed"]
    with torch.no_grad():
        logits = small(torch.tensor([prompt + o for o in out]))[:, len(prompt) - 1:-1]  # (n, 40, V)
    assert pit_p((o, sampling_probs(rows, params, prompt, o)) for o, rows in zip(out, logits, strict=True)) > 1e-3


def test_serve_config_option_reaches_the_engine_and_is_off_by_default():
    import re
    from pathlib import Path

    import yaml
    from pydantic import ValidationError

    from genserve.services.text.settings import TextArgs

    assert TextArgs().engine_config().speculative is None
    root = Path(__file__).resolve().parents[3]
    for name in ("serve_config.yaml", "serve_config.local.yaml"):
        text = (root / "deploy" / name).read_text()
        args = yaml.safe_load(text)["applications"][0]["args"]
        assert TextArgs(**args).engine_config().speculative is None  # documented, not on
        documented = yaml.safe_load(re.search(r"# (speculative: \{.*\})", text).group(1))
        assert TextArgs(**documented).engine_config().speculative == SpeculativeConfig()
    assert TextArgs(speculative={"num_tokens": 6}).engine_config().speculative.num_tokens == 6
    with pytest.raises(ValidationError, match="ngram_min"):
        TextArgs(speculative={"ngram_min": 5, "ngram_max": 2})
    with pytest.raises(ValidationError, match="draft_model_dir"):
        TextArgs(speculative={"method": "draft"})
    with pytest.raises(ValidationError, match="draft_model_dir"):
        TextArgs(speculative={"draft_model_dir": "/models/small"})
    drafted = TextArgs(speculative={"method": "draft", "draft_model_dir": "/models/small", "num_tokens": 3})
    assert drafted.engine_config().speculative == SpeculativeConfig(method="draft", num_tokens=3,
                                                                    draft_model_dir="/models/small")


def test_triton_backend_verifies_drafts_with_the_same_greedy_tokens(model, tmp_path):
    """The CUDA runner's path (Triton kernels, interpreted on CPU tensors: TRITON_INTERPRET=1, tests/conftest.py)
    scores the k + 1 decode rows of a draft through ``forward_paged`` and keeps greedy output identical."""
    pytest.importorskip("triton", reason="triton is not installed on this platform")
    from genserve.services.text.runners.cuda import CudaRunner
    from genserve.shared.blocks.backend import get_backend

    torch.manual_seed(0)
    directory = save_hf(hf_model("llama"), tmp_path, sharded=False)
    triton_model = load_model(directory, backend=get_backend("triton"))
    engine = LLMEngine(triton_model, byte_tokenizer(), EngineConfig(block_size=16, max_lookahead=1, speculative=SPEC))
    assert isinstance(engine.runner, CudaRunner)
    prompt, params = repetitive_prompts()[1], SamplingParams(max_tokens=12, temperature=0)
    assert engine.generate_batch([prompt], params) == engine_for(model, None).generate_batch([prompt], params)
    assert engine.speculation_stats()["accepted"] > 0


def test_a_sequence_whose_drafts_keep_failing_backs_off(model, monkeypatch):
    """Drafts that are never the argmax: after n failed passes in a row, min(2^n, 16) steps run without a draft."""
    from genserve.services.text.engine import engine as engine_module

    prompt, params = repetitive_prompts()[2], SamplingParams(max_tokens=40, temperature=0)
    expected = engine_for(model, None).generate_batch([prompt], params)
    never = next(t for t in range(VOCAB) if t not in expected[0][1])
    monkeypatch.setattr(engine_module, "propose_ngram", lambda tokens, k, lo, hi: [never])
    engine = engine_for(model, SPEC, max_lookahead=1)
    assert engine.generate_batch([prompt], params) == expected
    # 39 decode steps; drafts at steps 1, 4, 9, 18, 35 (each followed by 2, 4, 8, 16 steps without)
    assert engine.speculation_stats()["proposed_by_position"][0] == 5
    assert engine.speculation_stats()["accepted"] == 0
