"""Our loader + model against transformers on tiny random Llama, Mistral and Qwen2 checkpoints."""

from __future__ import annotations

import pytest
import torch
from text_helpers import VOCAB, hf_model, make_engine, save_hf

from genserve.services.text.engine.params import SamplingParams
from genserve.services.text.loader import load_model

CASES = {
    "llama": {},
    # A window shorter than the sequences below, so the band mask and windowed decode are exercised.
    "mistral": {"sliding_window": 12},
    "qwen2": {"tie_word_embeddings": True},
}
LOGITS_ATOL = 1e-4
NEW_TOKENS = 64


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    arch = request.param
    torch.manual_seed(0)
    model = hf_model(arch, **CASES[arch])
    directory = save_hf(model, tmp_path_factory.mktemp(arch), sharded=arch != "llama")
    return arch, model, directory


def test_sharded_and_unsharded_saves_are_what_we_think(checkpoint):
    arch, _, directory = checkpoint
    assert (directory / "model.safetensors.index.json").exists() == (arch != "llama")


def test_logits_match_transformers(checkpoint):
    arch, hf, directory = checkpoint
    model = load_model(directory)
    if arch == "qwen2":
        assert model.config.qkv_bias and model.config.tie_embeddings
        assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    ids = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        expected = hf(ids).logits
        got = model(ids)
    assert (got - expected).abs().max().item() <= LOGITS_ATOL


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return out[0, len(prompt):].tolist()


def test_greedy_generation_matches_transformers_alone_and_in_a_batch(checkpoint):
    _, hf, directory = checkpoint
    prompt = torch.randint(0, VOCAB, (23,)).tolist()
    expected = _hf_greedy(hf, prompt)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)

    alone = make_engine(directory, block_size=4).generate_batch([prompt], greedy)
    assert alone[0][1] == expected and alone[0][2] == "length"

    # Seven neighbours of other lengths and budgets; a small token budget forces chunked prefill alongside decode.
    others = [torch.randint(0, VOCAB, (n,)).tolist() for n in (1, 5, 9, 17, 30, 41, 3)]
    params = [greedy] + [SamplingParams(max_tokens=m, temperature=0) for m in (10, 64, 33, 5, 50, 20, 64)]
    engine = make_engine(directory, block_size=4, max_batched_tokens=24)
    results = engine.generate_batch([prompt, *others], params)
    assert results[0][1] == expected
    assert [len(r[1]) for r in results] == [p.max_tokens for p in params]
    assert engine.kv_blocks_free == engine.blocks.num_blocks


def fused_step_differences(directory, prompts: list[list[int]]) -> list[float]:
    """max |fused - forward_paged| of the logits of every decode step of ``prompts`` run together greedily, one
    kernel call per step, each compared against the module path on the same batch."""
    engine = make_engine(directory, block_size=4, max_lookahead=1)
    fused = engine.runner.fused
    assert fused is not None
    diffs: list[float] = []

    def both(batch, k_caches, v_caches, lora=None):
        reference = engine.model.forward_paged(batch, k_caches, v_caches)
        out = fused(batch, k_caches, v_caches, lora)  # rewrites the same K/V slots
        diffs.append(float((out - reference).abs().max()))
        return out

    engine.runner.fused = both
    engine.generate_batch(prompts, SamplingParams(max_tokens=24, temperature=0))
    return diffs


def test_fused_cpu_decode_steps_match_forward_paged(checkpoint, cpu_kernels):
    """The engine's fused CPU decode kernel against the module path: mixed context lengths in one batch, Mistral's
    window crossed, Qwen2's q/k/v biases; 11 sequences, so the products run a full tile of rows and a partial one."""
    _, _, directory = checkpoint
    prompts = [list(range(1, 20)), list(range(40, 45)), list(range(100, 131))]
    prompts += [list(range(3 * i + 1, 3 * i + 2 + i)) for i in range(8)]
    diffs = fused_step_differences(directory, prompts)
    assert len(diffs) >= 20
    assert max(diffs) <= LOGITS_ATOL


def test_fused_cpu_decode_steps_match_forward_paged_at_widths_off_the_32_block(tmp_path, cpu_kernels):
    """Widths that are not a multiple of 32 (48 and 72) leave the tiled products for plain dot products."""
    torch.manual_seed(0)
    directory = save_hf(hf_model("llama", hidden_size=48, intermediate_size=72), tmp_path, sharded=False)
    diffs = fused_step_differences(directory, [list(range(1, 20)), list(range(40, 45)), list(range(100, 131))])
    assert len(diffs) >= 20
    assert max(diffs) <= LOGITS_ATOL


def test_fused_cpu_decode_refuses_ids_and_positions_outside_its_tables(checkpoint, cpu_kernels):
    """The C step indexes the embedding and the RoPE tables directly: a bad id must be an error, not a wild read."""
    _, _, directory = checkpoint
    engine = make_engine(directory, block_size=4)
    model, kernel = engine.model, engine.runner.fused.kernel
    cos, sin = model.rope.tables()
    one = torch.zeros(1, dtype=torch.long)
    args = dict(slots=one, tables=torch.zeros(1, 1, dtype=torch.int32), lens=torch.ones(1, dtype=torch.int32),
                cos=cos, sin=sin, k_caches=engine.runner.k_caches, v_caches=engine.runner.v_caches)
    assert kernel.run(one, one, **args).shape == (1, model.config.vocab_size)
    with pytest.raises(ValueError, match="token id"):
        kernel.run(torch.tensor([model.config.vocab_size]), one, **args)
    with pytest.raises(ValueError, match="position"):
        kernel.run(one, torch.tensor([cos.shape[0]]), **args)
    # Greedy multi-step: 4 steps from position 0 need one block of 4 tokens, 5 steps a second one the table lacks.
    assert kernel.greedy(4, one, one * 0, **args).shape == (1, 4)
    with pytest.raises(ValueError, match="block table"):
        kernel.greedy(5, one, one * 0, **args)
