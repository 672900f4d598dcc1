"""Engine behaviour: seeds under concurrency, stop strings, cancellation, preemption, limits, streaming."""

from __future__ import annotations

import asyncio

import pytest
import torch
from text_helpers import VOCAB, byte_tokenizer, hf_model, save_hf

from genserve.services.text.engine.async_engine import AsyncLLMEngine
from genserve.services.text.engine.engine import EngineConfig, LLMEngine
from genserve.services.text.engine.params import EngineOverloaded, PromptTooLong, SamplingParams
from genserve.services.text.loader import load_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    return save_hf(hf_model("llama"), tmp_path_factory.mktemp("llama"), sharded=False)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


def engine_for(model, **config) -> LLMEngine:
    return LLMEngine(model, byte_tokenizer(), EngineConfig(**{"block_size": 4, **config}))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def test_same_seed_same_output_whatever_the_concurrency(model):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    target = prompts(1, seed=1)[0]
    alone = engine_for(model).generate_batch([target], params)[0]
    others = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in range(5)]
    crowded = engine_for(model, max_batched_tokens=20).generate_batch([*prompts(5), target], [*others, params])[-1]
    assert crowded == alone
    different = engine_for(model).generate_batch([target], SamplingParams(max_tokens=24, temperature=0.9, seed=8))
    assert different[0][1] != alone[1]


def test_preemption_under_a_tiny_block_budget_still_finishes_every_request_correctly(model):
    ps = prompts(6, seed=2)
    params = [SamplingParams(max_tokens=m, temperature=0) for m in (20, 30, 12, 25, 18, 30)]
    roomy = engine_for(model).generate_batch(ps, params)
    # 16 blocks of 4 tokens cannot hold six sequences of up to ~60 tokens at once.
    tight = engine_for(model, num_blocks=16, max_batched_tokens=16)
    squeezed = tight.generate_batch(ps, params)
    assert tight.counters().preemptions > 0
    assert squeezed == roomy
    assert tight.kv_blocks_free == 16


def test_a_sequence_larger_than_the_whole_cache_ends_with_context_length(model):
    engine = engine_for(model, num_blocks=4)  # 16 token slots
    text, ids, reason = engine.generate_batch([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=40, temperature=0))[0]
    assert reason == "context_length" and len(ids) == 16 - 5 + 1  # the last token needs no slot of its own
    assert engine.kv_blocks_free == 4


def test_context_limit_and_queue_limit_raise(model):
    engine = engine_for(model, max_context=32, max_waiting=2)
    with pytest.raises(PromptTooLong):
        engine.add_request("long", list(range(30)), SamplingParams(max_tokens=3), lambda d: None)
    engine.add_request("a", [1], SamplingParams(), lambda d: None)
    engine.add_request("b", [1], SamplingParams(), lambda d: None)
    with pytest.raises(EngineOverloaded):
        engine.add_request("c", [1], SamplingParams(), lambda d: None)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("a", [1], SamplingParams(), lambda d: None)


def test_stop_strings_are_cut_even_when_split_across_tokens(model):
    engine = engine_for(model)
    prompt = prompts(1, seed=3)[0]
    free_text, ids, _ = engine.generate_batch([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    # Byte-level tokens: a stop string spanning three bytes is necessarily split across three tokens.
    raw = byte_tokenizer().decode(ids)
    start = next(i for i in range(5, len(raw) - 3) if "\ufffd" not in raw[i:i + 3])
    stop = raw[start:start + 3]
    params = SamplingParams(max_tokens=40, temperature=0, stop=("never-appears", stop))
    deltas = []
    engine.add_request("s", prompt, params, deltas.append)
    while not deltas or deltas[-1].finish_reason is None:
        engine.step()
    streamed = "".join(d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop"
    assert streamed == raw[:raw.index(stop)]
    assert stop not in streamed and free_text.startswith(streamed)


def test_eos_finishes_with_reason_eos(model):
    engine = engine_for(model)
    prompt = prompts(1, seed=4)[0]
    _, ids, _ = engine.generate_batch([prompt], SamplingParams(max_tokens=10, temperature=0))[0]
    engine.eos_ids = frozenset({ids[4]})
    _, cut, reason = engine.generate_batch([prompt], SamplingParams(max_tokens=10, temperature=0))[0]
    assert reason == "eos" and cut == ids[: ids.index(ids[4]) + 1]


@pytest.fixture
def _fused(cpu_kernels) -> None:
    """The lookahead runs on the CPU runner's fused step: these tests need the C kernels."""


def _count_lookahead_calls(engine: LLMEngine) -> list[int]:
    """Record the step count of every multi-step kernel call the engine makes."""
    assert engine.runner.fused is not None, "the CPU runner should have its fused step for this fp32 Llama"
    calls: list[int] = []
    greedy = engine.runner.fused.greedy
    engine.runner.fused.greedy = lambda batch, steps, *caches: calls.append(steps) or greedy(batch, steps, *caches)
    return calls


def test_greedy_lookahead_gives_the_tokens_of_single_steps_in_fewer_kernel_calls(_fused, model):
    ps = prompts(4, seed=6)
    params = [SamplingParams(max_tokens=m, temperature=0, stop=stop) for m, stop in
              ((1, ()), (2, ()), (9, ()), (40, ("\n",)))]
    single = engine_for(model, max_lookahead=1).generate_batch(ps, params)
    engine = engine_for(model, max_lookahead=5)
    calls = _count_lookahead_calls(engine)
    assert engine.generate_batch(ps, params) == single
    assert calls and max(calls) == 5 and all(1 < c <= 5 for c in calls)
    assert engine.kv_blocks_free == engine.blocks.num_blocks
    # EOS in the middle of a multi-step run: the tokens after it are dropped.
    _, ids, _ = single[3]
    engine.eos_ids = frozenset({ids[6]})
    _, cut, reason = engine.generate_batch([ps[3]], params[3])[0]
    assert reason == "eos" and cut == ids[: ids.index(ids[6]) + 1]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12, temperature=0.8, seed=1),
                                    SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3),
                                    SamplingParams(max_tokens=12, temperature=0, logprobs=2)])
def test_lookahead_only_runs_plain_greedy_requests(_fused, model, params):
    engine = engine_for(model)
    calls = _count_lookahead_calls(engine)
    engine.generate_batch(prompts(2, seed=7), params)
    assert calls == []


def test_interactive_requests_get_every_token_from_its_own_step(_fused, model):
    engine = engine_for(model)
    calls = _count_lookahead_calls(engine)
    steps_with_tokens = []
    engine.add_request("live", prompts(1, seed=10)[0], SamplingParams(max_tokens=12, temperature=0),
                       lambda d: steps_with_tokens.append(len(d.token_ids)), interactive=True)
    while engine.has_work():
        engine.step()
    assert calls == [] and steps_with_tokens == [1] * 12


def test_lookahead_waits_while_requests_queue_for_admission(_fused, model):
    engine = engine_for(model, max_running=1)
    calls = _count_lookahead_calls(engine)
    params = SamplingParams(max_tokens=10, temperature=0)
    engine.add_request("first", prompts(1, seed=8)[0], params, lambda d: None)
    engine.add_request("second", prompts(1, seed=9)[0], params, lambda d: None)
    while "second" in {s.request_id for s in engine.scheduler.waiting}:
        engine.step()
    assert calls == []  # the first request ran token by token while the second waited
    while engine.has_work():
        engine.step()
    assert calls


def test_logprobs_are_the_model_distribution(model):
    engine = engine_for(model)
    prompt = prompts(1, seed=5)[0]
    deltas = []
    engine.add_request("lp", prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=3), deltas.append)
    engine.step()
    with torch.no_grad():
        expected = model(torch.tensor([prompt]))[0, -1].log_softmax(-1)
    lp = deltas[-1].logprobs[0]
    assert lp.token_id == int(expected.argmax())
    assert abs(lp.logprob - float(expected.max())) < 1e-4
    assert [t for t, _ in lp.top] == expected.topk(3).indices.tolist()


def test_streaming_cancellation_returns_every_block_at_once(model):
    engine = AsyncLLMEngine(engine_for(model))
    total = engine.engine.blocks.num_blocks

    async def consume() -> list:
        got = []
        stream = engine.stream(prompts(1, seed=6)[0], SamplingParams(max_tokens=200, temperature=0), "cancel-me")
        async for delta in stream:
            got.append(delta)
            if len(got) == 3:
                assert engine.info()["kv_blocks_free"] < total
                await stream.aclose()
                break
        return got

    got = asyncio.run(consume())
    assert len(got) == 3 and all(d.finish_reason is None for d in got)
    assert engine.info()["kv_blocks_free"] == total
    assert engine.abort("cancel-me") is False
    engine.shutdown()


def test_concurrent_streams_share_the_batch_and_match_offline_results(model):
    engine = AsyncLLMEngine(engine_for(model))
    ps = prompts(4, seed=7)
    params = SamplingParams(max_tokens=12, temperature=0)
    expected = engine_for(model).generate_batch(ps, params)

    async def one(i: int) -> tuple[str, list[int], str]:
        deltas = [d async for d in engine.stream(ps[i], params, f"r{i}")]
        return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], deltas[-1].finish_reason

    async def main():
        return await asyncio.gather(*(one(i) for i in range(4)))

    assert asyncio.run(main()) == expected
    assert engine.generate(ps[0], params) == expected[0]
    engine.shutdown()


def test_seed_options_gated_parallel_moe_round_trip_and_decode_like_the_full_forward(tmp_path):
    from genserve.services.text.config import LlamaConfig
    from genserve.services.text.loader import save_model
    from genserve.services.text.model import LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_position=128,
                      gated_attention=True, parallel_block=True, n_experts=4, n_experts_per_token=2)
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg).eval()
    save_model(tmp_path, model)
    loaded = load_model(tmp_path)
    assert loaded.config.architecture == "GenserveForCausalLM" and loaded.config.uses_seed_options
    ids = prompts(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(loaded(torch.tensor([ids])), model(torch.tensor([ids])))
        expected = list(ids)
        for _ in range(12):  # greedy without any cache: the full forward over the whole sequence each time
            expected.append(int(model(torch.tensor([expected]))[0, -1].argmax()))
    got = engine_for(loaded).generate_batch([ids], SamplingParams(max_tokens=12, temperature=0))[0][1]
    assert got == expected[len(ids):]
