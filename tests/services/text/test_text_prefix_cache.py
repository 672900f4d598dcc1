"""Automatic prefix caching: hashed full blocks shared across requests, LRU eviction only when a block is needed,
and outputs identical to the uncached engine under chunked prefill, abort and preemption, on both CPU paths."""

from __future__ import annotations

import pytest
import torch
from text_helpers import VOCAB, admit, byte_tokenizer, hf_model, ids, save_hf

from genserve.services.text.engine.engine import EngineConfig, LLMEngine
from genserve.services.text.engine.kv_cache import BlockManager, block_hash
from genserve.services.text.engine.params import SamplingParams
from genserve.services.text.loader import load_model
from genserve.services.text.runners.cpu import CpuRunner


# ---- the block manager --------------------------------------------------------------------------------------
def test_full_blocks_hit_by_their_chained_hash_and_the_last_token_is_always_computed():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = ids(10, 0)
    assert admit(bm, "a", a) == 0 and bm.num_cached == 2  # two full blocks; the 2-token tail is not cached
    assert admit(bm, "b", a[:8] + ids(5, 1)) == 8
    assert bm.tables["b"][:2] == bm.tables["a"][:2]  # shared, not copied
    assert admit(bm, "c", a[:4] + [(a[4] + 1) % VOCAB] + a[5:]) == 4  # one changed token in block 1
    assert admit(bm, "d", [(a[0] + 1) % VOCAB] + a[1:]) == 0  # block 1 equal, but its prefix is not
    assert bm.match_prefix("e", a[:8], []) == 4  # 8 tokens: the 8th must be computed for its logits
    # The chain: the same four tokens hash differently after different prefixes.
    assert block_hash(b"", a[4:8]) != block_hash(block_hash(b"", a[:4]), a[4:8])


def test_output_tokens_are_cached_too_and_matched_after_a_preemption():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt, output = ids(6, 2), ids(5, 3)
    bm.match_prefix("a", prompt, [])
    bm.grow("a", 11)
    bm.register("a", prompt, output, 11)  # prompt + 5 generated tokens: two full blocks
    bm.free("a")  # preempted: its cached blocks stay
    assert bm.match_prefix("a", prompt, output) == 8


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_and_only_when_a_block_is_needed():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = ids(4, 4), ids(4, 5)  # two full blocks each
    admit(bm, "a", a)
    admit(bm, "b", b)
    bm.free("a")
    bm.free("b")  # LRU order, tables released back to front: a1, a0, b1, b0
    assert bm.num_free == 6 and bm.num_cached == 4
    bm.grow("x", 4)  # two blocks: the two plain free ones, nothing is evicted
    assert bm.num_cached == 4 and bm.num_free == 4

    def cached_tokens(tokens: list[int]) -> int:
        hit = bm.match_prefix("probe", tokens + [0], [])  # one token more, so both blocks may match
        bm.free("probe")  # a use: the matched blocks become the most recently used
        return hit

    assert cached_tokens(a) == 4  # order now: b1, b0, a1, a0
    bm.grow("y", 2)  # evicts b1
    assert bm.num_cached == 3 and cached_tokens(b) == 2  # b0 is used: a1, a0, b0
    bm.grow("z", 2)  # evicts a1
    assert cached_tokens(a) == 2 and cached_tokens(b) == 2
    bm.grow("w", 4)  # the last two cached blocks go too
    assert bm.num_cached == 0 and bm.num_free == 0


def test_referenced_blocks_are_never_evicted_and_return_when_the_last_user_frees_them():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = ids(5, 6)
    admit(bm, "a", a)  # 3 blocks
    assert admit(bm, "b", a) == 4  # shares 2, takes 1
    assert bm.num_free == 0
    with pytest.raises(MemoryError):
        bm.grow("c", 2)
    bm.free("a")
    assert bm.num_free == 1  # a's own tail block; the shared ones are still b's
    bm.free("b")
    assert bm.num_free == 4 and bm.num_cached == 2


def test_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, caching=False)
    a = ids(10, 7)
    assert admit(bm, "a", a) == 0
    assert admit(bm, "b", a) == 0 and bm.num_cached == 0


# ---- the engine ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.manual_seed(0)
    return load_model(save_hf(hf_model("llama"), tmp_path_factory.mktemp("llama"), sharded=False))


def engine_for(model, *, generic: bool = False, **config) -> LLMEngine:
    runner = CpuRunner(model, fused=False) if generic else None
    return LLMEngine(model, byte_tokenizer(), EngineConfig(**{"block_size": 4, **config}), runner=runner)


SYSTEM = ids(40, 8)
PROMPTS = [SYSTEM + ids(n, 10 + i) for i, n in enumerate((3, 9, 1, 14))]
GREEDY = [SamplingParams(max_tokens=m, temperature=0) for m in (12, 20, 9, 16)]


def one_by_one(engine: LLMEngine) -> list:
    return [engine.generate_batch([p], g)[0] for p, g in zip(PROMPTS, GREEDY, strict=True)]


@pytest.fixture(scope="module")
def expected(model) -> list:
    """PROMPTS' greedy results without prefix caching, each request alone."""
    return one_by_one(engine_for(model, prefix_caching=False))


@pytest.mark.parametrize("generic", [False, True], ids=["cpu-runner", "generic-forward"])
def test_greedy_outputs_are_identical_with_the_cache_on_and_off(model, generic, expected):
    off = engine_for(model, generic=generic, prefix_caching=False)
    on = engine_for(model, generic=generic)
    assert one_by_one(off) == expected and off.scheduler.hit_tokens == 0
    assert one_by_one(on) == expected
    # Each later request reuses the 40-token system prompt's 10 blocks; the first found nothing.
    assert on.scheduler.hit_tokens == 3 * 40
    assert on.settings()["prefix_cache_hit_tokens"] == 120 and on.settings()["prefix_caching"]
    # Together in one batch (nothing cached yet: the blocks register after the step that fills them) and again.
    assert on.generate_batch(PROMPTS, GREEDY) == expected
    assert on.kv_blocks_free == on.blocks.num_blocks


def test_chunked_prefill_hits_blocks_a_running_request_has_already_filled(model, expected):
    engine = engine_for(model, max_batched_tokens=12)  # a 43-token prompt takes four steps
    out = [[] for _ in PROMPTS]
    engine.add_request("first", PROMPTS[0], GREEDY[0], out[0].append)
    engine.step()
    engine.step()  # 24 tokens computed: 6 blocks registered
    for i in range(1, 4):
        engine.add_request(f"r{i}", PROMPTS[i], GREEDY[i], out[i].append)
    while engine.has_work():
        engine.step()
    assert engine.scheduler.hit_tokens >= 24
    assert [("".join(d.text for d in o), [t for d in o for t in d.token_ids], o[-1].finish_reason)
            for o in out] == expected


def test_an_aborted_request_leaves_its_filled_blocks_cached_and_frees_the_rest(model, expected):
    engine = engine_for(model, max_batched_tokens=16)
    engine.add_request("gone", PROMPTS[1], GREEDY[1], lambda d: None)
    engine.step()  # 16 of 49 prompt tokens: 4 blocks filled and registered
    assert engine.abort("gone")
    assert engine.kv_blocks_free == engine.blocks.num_blocks and engine.blocks.num_cached == 4
    assert engine.generate_batch([PROMPTS[1]], GREEDY[1])[0] == expected[1]
    assert engine.scheduler.hit_tokens == 16


def test_preemption_with_shared_prefixes_gives_the_same_tokens_and_returns_every_block(model, expected):
    # 20 blocks of 4: even sharing the system prompt's 10, the four requests (50-70 tokens) cannot all stay.
    tight = engine_for(model, num_blocks=20, max_batched_tokens=16)
    assert tight.generate_batch(PROMPTS, GREEDY) == expected
    assert tight.counters().preemptions > 0 and tight.counters().hit_tokens > 0
    assert tight.kv_blocks_free == 20


def test_the_cuda_runner_reads_cached_prefixes_like_the_cpu_runner(tmp_path):
    """The CUDA runner's math (Triton kernels, run by the interpreter on CPU tensors): a prefill chunk that starts
    after 32 cached tokens attends to them through the paged cache."""
    pytest.importorskip("triton", reason="triton is not installed on this platform")
    from genserve.shared.blocks.backend import get_backend

    torch.manual_seed(0)
    directory = save_hf(hf_model("llama"), tmp_path, sharded=False)
    prompts = [SYSTEM[:32] + ids(5, 40), SYSTEM[:32] + ids(7, 41)]
    greedy = SamplingParams(max_tokens=4, temperature=0)
    cpu = LLMEngine(load_model(directory), byte_tokenizer(), EngineConfig(block_size=16, prefix_caching=False))
    triton = LLMEngine(load_model(directory, backend=get_backend("triton")), byte_tokenizer(),
                       EngineConfig(block_size=16, max_lookahead=1))
    assert triton.runner.name == "cuda"
    assert [triton.generate_batch([p], greedy)[0] for p in prompts] == [cpu.generate_batch([p], greedy)[0]
                                                                         for p in prompts]
    assert triton.scheduler.hit_tokens == 32
