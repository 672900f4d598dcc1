"""Draft-model speculation (engine/draft.py): greedy output token-identical to decoding without it for every served
architecture, alone, in mixed batches, under preemption, on the fused step and the Triton path; the draft model's
own K/V kept in step with the target's (a draft that is the target itself is accepted every time); sampled output
distributed as the model's (a chi-square test of the randomised PIT, as test_text_speculative.py does for n-grams)."""

from __future__ import annotations

import json

import pytest
import torch
from text_helpers import VOCAB, byte_tokenizer, hf_model, save_hf

from genserve.services.text.engine.engine import EngineConfig, LLMEngine
from genserve.services.text.engine.params import SamplingParams
from genserve.services.text.engine.speculative import SpeculativeConfig
from genserve.services.text.loader import load_model

JSON_SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
                          "required": ["n"], "additionalProperties": False})


def draft_spec(num_tokens: int = 4, **fields) -> SpeculativeConfig:
    # The engine takes the loaded draft model; the folder is what a serve config names (AsyncLLMEngine loads it).
    return SpeculativeConfig(method="draft", num_tokens=num_tokens, draft_model_dir="draft", **fields)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    return save_hf(hf_model("llama"), tmp_path_factory.mktemp("llama"), sharded=False)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """A different, smaller model with the same vocabulary: a Qwen2 of one layer."""
    return save_hf(hf_model("qwen2", num_hidden_layers=1, hidden_size=32, intermediate_size=48),
                   tmp_path_factory.mktemp("qwen2-draft"), sharded=False)


def engine_for(target_dir, draft_dir=None, spec: SpeculativeConfig | None = None, **config) -> LLMEngine:
    draft = load_model(draft_dir) if draft_dir is not None else None
    spec = spec if spec is not None or draft is None else draft_spec()
    return LLMEngine(load_model(target_dir), byte_tokenizer(), EngineConfig(**{
        "block_size": 4, "num_blocks": 256, "speculative": spec, **config}), draft_model=draft)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 23, 5, 14)]


MIXED = [SamplingParams(max_tokens=40, temperature=0),
         SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.2, logprobs=2),
         SamplingParams(max_tokens=25, temperature=0.9, seed=5),
         SamplingParams(max_tokens=30, temperature=0, json_schema=JSON_SCHEMA)]


def test_a_draft_that_is_the_target_is_always_accepted_and_changes_nothing(llama_dir):
    """The draft model's K/V (its own cache, at the target's slots) follows every accepted, rejected and bonus
    token: the target drafting for itself is accepted at every position, alone and in a mixed batch."""
    ps, greedy = prompts(), SamplingParams(max_tokens=40, temperature=0)
    plain = engine_for(llama_dir)
    engine = engine_for(llama_dir, llama_dir)
    assert engine.generate_batch([ps[1]], greedy) == plain.generate_batch([ps[1]], greedy)
    stats = engine.speculation_stats()
    assert stats["proposed"] >= 30 and stats["acceptance_rate"] > 0.97
    engine = engine_for(llama_dir, llama_dir)
    assert engine.generate_batch(ps, MIXED) == plain.generate_batch(ps, MIXED)
    assert engine.kv_blocks_free == engine.blocks.num_blocks


def test_greedy_with_another_draft_model_is_token_identical_in_mixed_batches(llama_dir, other_draft_dir):
    ps = prompts()
    engine = engine_for(llama_dir, other_draft_dir, draft_spec(num_tokens=3))
    assert engine.generate_batch(ps, MIXED) == engine_for(llama_dir).generate_batch(ps, MIXED)
    stats = engine.speculation_stats()
    assert stats["proposed"] > 0 and stats["proposed_by_position"][2] > 0
    assert engine.kv_blocks_free == engine.blocks.num_blocks


def test_draft_speculation_survives_preemption_and_opt_outs(llama_dir):
    """24 blocks of 4 tokens cannot hold four sequences of ~60 tokens: preempted sequences recompute, their draft
    K/V too; a request with ``speculative=False`` is never drafted for."""
    ps, greedy = prompts(), SamplingParams(max_tokens=40, temperature=0)
    tight = engine_for(llama_dir, llama_dir, num_blocks=24, max_batched_tokens=24)
    assert tight.generate_batch(ps, greedy) == engine_for(llama_dir).generate_batch(ps, greedy)
    assert tight.counters().preemptions > 0 and tight.kv_blocks_free == 24
    assert tight.speculation_stats()["acceptance_rate"] > 0.9
    opted_out = engine_for(llama_dir, llama_dir)
    off = SamplingParams(max_tokens=40, temperature=0, speculative=False)
    assert opted_out.generate_batch([ps[0]], off)[0][1] == engine_for(llama_dir).generate_batch([ps[0]], greedy)[0][1]
    assert opted_out.speculation_stats()["proposed"] == 0


@pytest.mark.parametrize("arch, overrides", [
    ("mistral", {"sliding_window": 8}),  # a hybrid KV cache: the draft reads the full-attention group's tables
    ("qwen2", {}),
    ("phi3", {}),
    ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16}),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 8,
                 "layer_types": ["sliding_attention", "full_attention"]}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_every_served_architecture_decodes_the_same_with_a_draft_model(arch, overrides, tmp_path, other_draft_dir):
    torch.manual_seed(0)
    target = save_hf(hf_model(arch, **overrides), tmp_path, sharded=False)
    ps, params = prompts()[:2], [SamplingParams(max_tokens=24, temperature=0),
                                 SamplingParams(max_tokens=20, temperature=0.8, seed=2)]
    expected = engine_for(target).generate_batch(ps, params)
    for draft in (target, other_draft_dir):
        engine = engine_for(target, draft)
        assert engine.generate_batch(ps, params) == expected
        assert engine.speculation_stats()["proposed"] > 0
    self_draft = engine_for(target, target)
    self_draft.generate_batch(ps[:1], params[:1])
    assert self_draft.speculation_stats()["acceptance_rate"] > 0.9


class CountingGreedy:
    """A runner's multi-step greedy path, recording the steps of every call."""

    def __init__(self, runner):
        self.runner, self.steps = runner, []
        self.inner = runner.execute_greedy

    def __call__(self, batch, steps, *, lora=None):
        self.steps.append(steps)
        return self.inner(batch, steps, lora=lora)


def test_the_draft_model_drafts_in_one_fused_call_per_step(cpu_kernels, llama_dir):
    """On the CPU fused step, the newest token and k - 1 drafts run as one k-step greedy call of the draft's runner
    (its K/V caught up first by a chunk when the sequence arrives or after steps without drafts)."""
    engine = engine_for(llama_dir, llama_dir, draft_spec(num_tokens=5))
    runner = engine.drafter.runner
    assert runner.fused is not None
    runner.execute_greedy = counting = CountingGreedy(runner)
    greedy = SamplingParams(max_tokens=30, temperature=0)
    assert engine.generate_batch([prompts()[1]], greedy) == engine_for(llama_dir).generate_batch([prompts()[1]],
                                                                                                  greedy)
    assert counting.steps and set(counting.steps) <= {6, 5, 4, 3, 2} and counting.steps[1] == 6


def test_triton_backend_drafts_and_verifies_with_the_same_greedy_tokens(llama_dir):
    """The CUDA runner's path for both models (Triton kernels, interpreted on CPU tensors): one decode step per
    draft token, then the verify pass."""
    pytest.importorskip("triton", reason="triton is not installed on this platform")
    from genserve.services.text.runners.cuda import CudaRunner
    from genserve.shared.blocks.backend import get_backend

    triton = get_backend("triton")
    engine = LLMEngine(load_model(llama_dir, backend=triton), byte_tokenizer(), EngineConfig(
        block_size=16, max_lookahead=1, speculative=draft_spec(num_tokens=3)),
        draft_model=load_model(llama_dir, backend=triton))
    assert isinstance(engine.drafter.runner, CudaRunner)
    prompt, params = prompts()[0], SamplingParams(max_tokens=10, temperature=0)
    assert engine.generate_batch([prompt], params) == engine_for(llama_dir).generate_batch([prompt], params)
    assert engine.speculation_stats()["accepted"] > 0


def test_sampled_draft_speculation_follows_the_model(tmp_path):
    """Every token sampled with a draft model, drafted or not, is a draw from the target's distribution after
    penalties, temperature and top-p: the randomised PIT of the >= 2,500 tokens is uniform (chi-square, 10 bins)."""
    from test_text_speculative import pit_p, sampling_probs

    vocab = 16
    torch.manual_seed(1)
    target = load_model(save_hf(hf_model("llama", vocab_size=vocab), tmp_path / "t", sharded=False))
    draft = load_model(save_hf(hf_model("llama", vocab_size=vocab, num_hidden_layers=1), tmp_path / "d",
                               sharded=False))
    prompt = list(range(vocab))
    params = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, presence_penalty=0.5)
    n = 64
    engine = LLMEngine(target, byte_tokenizer(), EngineConfig(
        block_size=16, num_blocks=n * 6, max_running=n, speculative=draft_spec(num_tokens=3, max_batch=n)),
        draft_model=draft)
    out = [ids for _, ids, _ in engine.generate_batch([prompt] * n, params)]
    stats = engine.speculation_stats()
    assert stats["proposed_by_position"][2] > 50 and 0 < stats["accepted"] < stats["proposed"]
    with torch.no_grad():
        logits = target(torch.tensor([prompt + o for o in out]))[:, len(prompt) - 1:-1]  # (n, 40, V)
    assert pit_p((o, sampling_probs(rows, params, prompt, o)) for o, rows in zip(out, logits, strict=True)) > 1e-3


def test_a_draft_config_without_a_draft_model_is_refused(llama_dir):
    with pytest.raises(ValueError, match="draft_model_dir"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="draft_model_dir"):
        SpeculativeConfig(method="ngram", draft_model_dir="somewhere")
    with pytest.raises(ValueError, match="draft model is given exactly"):
        LLMEngine(load_model(llama_dir), byte_tokenizer(), EngineConfig(speculative=draft_spec()))
    with pytest.raises(ValueError, match="draft model is given exactly"):
        LLMEngine(load_model(llama_dir), byte_tokenizer(), EngineConfig(), draft_model=load_model(llama_dir))
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="no")


def test_generate_cli_drafts_with_a_draft_model_and_refuses_another_tokenizer(tmp_path, capsys):
    """``genserve generate --speculative draft --draft-model-dir DIR``: the demo model drafting for itself gives the
    tokens of decoding without speculation and reports its acceptance; a draft folder whose tokenizer differs is
    refused naming draft_model_dir, and a draft without its folder names the flag."""
    import argparse
    import shutil

    from genserve.services.text import generate
    from genserve.services.text.engine.async_engine import DEMO_DIR

    def run(*extra: str) -> dict:
        parser = argparse.ArgumentParser()
        generate.add_arguments(parser)
        code = generate.run(parser.parse_args(["--model-dir", str(DEMO_DIR), "--temperature", "0", "--max-tokens",
                                               "24", "--json", *extra, "def main():"]))
        out = capsys.readouterr()
        return {"code": code, **(json.loads(out.out) if code == 0 else {"err": out.err})}

    plain = run()
    drafted = run("--speculative", "draft", "--draft-model-dir", str(DEMO_DIR), "--num-speculative-tokens", "3")
    assert drafted["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 24
    assert drafted["speculation"]["proposed"] > 0 and drafted["speculation"]["acceptance_rate"] > 0.9
    other = shutil.copytree(DEMO_DIR, tmp_path / "other")
    byte_tokenizer().backend.save(str(other / "tokenizer.json"))
    refused = run("--speculative", "draft", "--draft-model-dir", str(other))
    assert refused["code"] == 2 and "draft_model_dir" in refused["err"] and "tokenizer" in refused["err"]
    missing = run("--speculative", "draft")
    assert missing["code"] == 2 and "--draft-model-dir" in missing["err"]
