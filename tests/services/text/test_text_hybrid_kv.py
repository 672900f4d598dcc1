"""The hybrid KV-cache allocation (issue 31; engine/kv_cache.py): sliding-window layers keep only their window's
blocks in tables of their own, from the pool the full-attention layers use. Checked: the grouping, the release of
blocks that left the window, prefix hits that never need an evicted window block, at least 3x the tokens of a
Gemma-3-shaped model in the same KV budget (blocks counted), and greedy tokens equal to transformers' under
preemption, chunked prefill and prefix hits, on forward_paged (Gemma 3) and on the fused CPU step (a Qwen2 with
one full and one sliding layer)."""

from __future__ import annotations

import pytest
import torch
from text_helpers import VOCAB, admit, byte_tokenizer, hf_model, ids, make_engine, save_hf

from genserve.services.text.engine.engine import EngineConfig, LLMEngine
from genserve.services.text.engine.kv_cache import BlockManager, KVGroup, kv_groups
from genserve.services.text.engine.params import SamplingParams
from genserve.services.text.loader import load_model

WINDOW = 8
GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]  # 5 of 6 layers slide, as in Gemma 3




@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A random 6-layer Gemma 3 (5 sliding layers over 8 tokens, 1 global) and its saved folder."""
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=WINDOW,
        layer_types=GEMMA3_LAYERS, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        attn_implementation="eager")
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in hf.named_parameters():  # Gemma's gains are zero-centred: (1 + w)
            p.copy_((0.1 if "norm" in name else 0.08) * torch.randn(p.shape, generator=gen))
    directory = tmp_path_factory.mktemp("gemma3_hybrid")
    hf.save_pretrained(directory)
    return hf, directory


def test_layers_fall_into_groups_of_one_size_by_kind_full_attention_first():
    assert kv_groups([8, 8, 0, 8]) == (KVGroup(0, (2,)), KVGroup(8, (0,)), KVGroup(8, (1,)), KVGroup(8, (3,)))
    assert kv_groups([8, 0] * 2) == (KVGroup(0, (1, 3)), KVGroup(8, (0, 2)))
    assert kv_groups([0] * 3) == (KVGroup(0, (0, 1, 2)),)
    twelve = kv_groups([0 if (i + 1) % 6 == 0 else 16 for i in range(12)])  # Gemma 3's pattern: pairs
    assert [g.window for g in twelve] == [0] + [16] * 5 and {len(g.layers) for g in twelve} == {2}


def test_a_sliding_group_releases_the_blocks_every_later_token_has_left_behind():
    bm = BlockManager(num_blocks=20, block_size=4, caching=False, groups=kv_groups([WINDOW, 0]))
    bm.grow("a", 20)
    assert bm.num_free == 20 - 2 * 5
    bm.register("a", ids(20, 0), [], 20)
    # The token at 20 attends to 13..20: blocks 3 and up; the full group keeps all five.
    full, sliding = bm.group_tables["a"]
    assert len(full) == len(sliding) == 5 and bm.null_block not in full
    assert sliding[:3] == [bm.null_block] * 3 and bm.num_free == 20 - 5 - 2
    bm.grow("a", 21)  # a sixth block in both groups
    assert bm.num_free == 20 - 6 - 3
    assert bm.truncate("a", 20) == 2 and bm.free("a") == 5 + 2 and bm.num_free == 20


def test_a_prefix_hit_survives_evicted_blocks_outside_its_window_but_not_evicted_blocks_inside():
    bm = BlockManager(num_blocks=14, block_size=4, groups=kv_groups([WINDOW, 0]))
    a = ids(24, 1)
    assert admit(bm, "a", a) == 0  # 6 blocks in each group; the sliding group then releases blocks 0-3
    # A request with a's 24 tokens and one more needs the sliding blocks 4-5 only: they are a's.
    assert bm.match_prefix("b", a + [7], []) == 24
    assert bm.group_tables["b"][1] == [bm.null_block] * 4 + bm.group_tables["a"][1][4:]
    bm.free("b")
    bm.free("a")
    # 6 fresh blocks: the 2 never used, then the 4 least recently used cached ones, a's sliding blocks 0-3.
    bm.grow("d", 12)
    bm.free("d")
    assert bm.match_prefix("e", a + [7], []) == 24  # its window (blocks 4-5) is still cached
    bm.free("e")
    # a's first 12 tokens are cached in the full group, but the token at 12 would need sliding blocks 1-2, at 8 blocks
    # 0-1, at 4 block 0: all evicted, so no hit at all rather than one that reads evicted keys.
    assert bm.match_prefix("c", a[:12] + ids(4, 2), []) == 0


def decode_until_full(bm: BlockManager, n_seqs: int) -> int:
    """Grow ``n_seqs`` sequences a token at a time, round robin, as decoding does, until one cannot: the tokens
    then held."""
    lens = [0] * n_seqs
    while True:
        for i in range(n_seqs):
            if not bm.can_grow(f"s{i}", lens[i] + 1):
                return sum(lens)
            lens[i] += 1
            bm.grow(f"s{i}", lens[i])
            bm.register(f"s{i}", [], [], lens[i])


def test_a_gemma3_shaped_model_fits_at_least_three_times_the_tokens_in_the_same_budget(gemma3):
    _, directory = gemma3
    budget = 200 * 4 * 6 * 256  # 200 blocks of 4 tokens x 6 layers x 256 bytes (K and V, 2 heads x 16, fp32)
    engines = {hybrid: LLMEngine(load_model(directory), byte_tokenizer(), EngineConfig(
        block_size=4, kv_cache_bytes=budget, prefix_caching=False, hybrid_kv_cache=hybrid)) for hybrid in (True, False)}
    for engine in engines.values():  # the same bytes allocated: 6 layers of 200 blocks, or 1200 blocks of one layer
        caches = {t.data_ptr(): t for t in (*engine.runner.k_caches, *engine.runner.v_caches)}
        assert engine.kv_cache_bytes == budget
        assert sum(t.nbytes for t in caches.values()) == budget + budget // engine.blocks.num_blocks  # + null block
    hybrid, uniform = engines[True], engines[False]
    assert (hybrid.blocks.num_blocks, uniform.blocks.num_blocks) == (1200, 200)
    # One request alone: 4 tokens a block of the full layer, the sliding layers at 3 blocks each.
    assert uniform.kv_tokens_fit == 800 and hybrid.kv_tokens_fit == (1200 - 5 * 3) * 4
    assert hybrid.kv_tokens_fit >= 3 * uniform.kv_tokens_fit
    # Eight sequences decoding side by side, token by token, until a block is missing.
    held = {name: decode_until_full(engine.blocks, 8) for name, engine in (("hybrid", hybrid), ("uniform", uniform))}
    assert held["uniform"] == 800 and held["hybrid"] >= 3 * held["uniform"]
    assert [k["n_layers"] for k in hybrid.kv_layer_kinds] == [1, 5]
    assert hybrid.settings()["kv_tokens_fit"] == hybrid.kv_tokens_fit


def test_gemma3_greedy_tokens_match_transformers_under_preemption_chunks_and_prefix_hits(gemma3):
    hf, directory = gemma3
    shared = ids(20, 3)
    prompts = [shared + ids(9, 4), shared + ids(3, 5), ids(41, 6), ids(5, 7)]
    budgets = [24, 20, 16, 24]
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p):]
                .tolist() for p, n in zip(prompts, budgets, strict=True)]
    # 40 blocks of one layer: each sequence holds every block of the global layer and 3 per sliding one, so the four
    # need more than that and the newest are preempted; 12-token steps chunk every prefill.
    engine = make_engine(directory, block_size=4, num_blocks=40, max_batched_tokens=12)
    params = [SamplingParams(max_tokens=n, temperature=0) for n in budgets]
    for _ in range(2):  # the second round starts from the blocks the first left cached
        results = engine.generate_batch(prompts, params)
        assert [r[1] for r in results] == expected
    counters = engine.counters()
    assert counters.preemptions > 0 and counters.hit_tokens > 0
    assert engine.kv_blocks_free == engine.blocks.num_blocks


def test_the_fused_cpu_step_reads_each_layer_kinds_own_tables(tmp_path, cpu_kernels):
    """A Qwen2 with one full and one sliding layer (max_window_layers): two groups, greedy lookahead on the fused
    step, equal to transformers and to forward_paged."""
    hf = hf_model("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    directory = save_hf(hf, tmp_path, sharded=False)
    prompts = [ids(19, 8), ids(5, 9), ids(31, 10)]
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]
    engine = make_engine(directory, block_size=4)
    assert engine.runner.fused is not None and len(engine.blocks.windows) == 2 and engine.runner.max_steps(3) > 1
    diffs = []
    fused = engine.runner.fused

    def both(batch, k_caches, v_caches, lora=None):
        reference = engine.model.forward_paged(batch, k_caches, v_caches)
        out = fused(batch, k_caches, v_caches, lora)  # rewrites the same K/V slots
        diffs.append(float((out - reference).abs().max()))
        return out

    results = engine.generate_batch(prompts, SamplingParams(max_tokens=24, temperature=0))  # lookahead: greedy()
    assert [r[1] for r in results] == expected
    engine.runner.fused = both  # one step per call from here on: every step compared
    engine.runner.max_lookahead = 1
    results = engine.generate_batch(prompts, SamplingParams(max_tokens=24, temperature=0))
    assert [r[1] for r in results] == expected and len(diffs) >= 20 and max(diffs) <= 1e-4
