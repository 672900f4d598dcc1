"""The fused CPU decode step on bf16 and int8 models: bf16 weights, embedding and K/V cache, and int8 rows with
per-row scales, read inside the step with fp32 activations."""

from __future__ import annotations

import pytest
import torch
from text_helpers import byte_tokenizer, hf_model, save_hf

from genserve.services.text.engine.engine import EngineConfig, LLMEngine
from genserve.services.text.engine.params import SamplingParams
from genserve.services.text.loader import load_model
from genserve.services.text.quantize import Int8Linear

PROMPTS = [list(range(1, 20)), list(range(40, 45)), list(range(100, 131))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Qwen2-style checkpoint (q/k/v biases, tied head) with widths that are whole blocks of 32."""
    torch.manual_seed(0)
    return save_hf(hf_model("qwen2", tie_word_embeddings=True), tmp_path_factory.mktemp("qwen2"), sharded=False)


def _engine(model) -> LLMEngine:
    return LLMEngine(model, byte_tokenizer(), EngineConfig(block_size=4, max_lookahead=1))


def _step(engine: LLMEngine, tokens: list[int], caches: tuple[list[torch.Tensor], list[torch.Tensor]]
          ) -> torch.Tensor:
    """Logits of one fused step for len(tokens) sequences at position 0, sequence i in cache block i."""
    fused, m = engine.runner.fused, len(tokens)
    ids = torch.tensor(tokens)
    slots = torch.arange(m) * 4
    return fused.kernel.run(ids, torch.zeros(m, dtype=torch.long), slots, torch.arange(m, dtype=torch.int32)[:, None],
                            torch.ones(m, dtype=torch.int32), fused.cos, fused.sin, *caches)


def _caches(model, dtype: torch.dtype, blocks: int = 4) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    cfg = model.config
    shape = (blocks, 4, cfg.n_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(cfg.n_layers)], \
        [torch.zeros(shape, dtype=dtype) for _ in range(cfg.n_layers)]


def test_bf16_weights_embedding_and_cache_are_read_as_their_fp32_values(checkpoint, cpu_kernels):
    """A bf16 model's step equals the fp32 step of the same (bf16-rounded) weights: the same logits, and a bf16 cache
    holds the fp32 step's first-layer keys and values rounded to nearest-even, as torch's .to(torch.bfloat16) rounds
    them."""
    bf16 = _engine(load_model(checkpoint, "bfloat16"))
    widened = load_model(checkpoint, "float32")
    widened.load_state_dict({k: v.float() for k, v in bf16.model.state_dict().items()})
    fp32 = _engine(widened)
    assert bf16.runner.fused is not None and bf16.runner.k_caches[0].dtype == torch.bfloat16
    tokens = [5, 77, 200]  # three rows: both kernels take the register tile, so the sums run in the same order

    fp32_caches = _caches(widened, torch.float32)
    reference = _step(fp32, tokens, fp32_caches)
    same_cache = _step(bf16, tokens, _caches(widened, torch.float32))
    assert torch.equal(same_cache, reference)

    bf16_caches = _caches(widened, torch.bfloat16)
    _step(bf16, tokens, bf16_caches)
    # the first layer's keys and values come from the same inputs; later layers attend over the rounded values
    for ours, theirs in ((bf16_caches[0][0], fp32_caches[0][0]), (bf16_caches[1][0], fp32_caches[1][0])):
        assert theirs.abs().sum() > 0
        assert torch.equal(ours, theirs.to(torch.bfloat16))


def test_bf16_engine_decodes_through_the_fused_step_within_bf16_rounding_of_the_torch_path(checkpoint, cpu_kernels):
    engine = _engine(load_model(checkpoint, "bfloat16"))
    fused, diffs = engine.runner.fused, []

    def both(batch, k_caches, v_caches, lora=None):
        reference = engine.model.forward_paged(batch, k_caches, v_caches).float()
        out = fused(batch, k_caches, v_caches, lora)  # rewrites the same K/V slots
        diffs.append(float((out - reference).abs().max() / reference.abs().max()))
        return out

    engine.runner.fused = both
    engine.generate_batch(PROMPTS, SamplingParams(max_tokens=16, temperature=0))
    assert len(diffs) >= 12
    assert max(diffs) < 0.03  # bf16 activations on the torch path: a few of its 8-bit mantissa's steps


def test_int8_rows_decode_as_their_dequantized_fp32_weights(checkpoint, cpu_kernels):
    """The int8 model's fused step against forward_paged of an fp32 model holding scale * q for every linear layer:
    the step keeps fp32 activations, so the two agree to fp32 rounding."""
    engine = _engine(load_model(checkpoint, "int8"))
    assert engine.runner.fused is not None
    reference = load_model(checkpoint, "float32")
    int8_layers = {name: m for name, m in engine.model.named_modules() if isinstance(m, Int8Linear)}
    assert len(int8_layers) > 7
    for name, module in reference.named_modules():
        if name in int8_layers:  # a new tensor each: the tied head must not overwrite the embedding
            q = int8_layers[name]
            module.weight = torch.nn.Parameter(q.scales.float()[:, None] * q.weight.float(), requires_grad=False)
    fused, diffs = engine.runner.fused, []

    def both(batch, k_caches, v_caches, lora=None):
        expected = reference.forward_paged(batch, k_caches, v_caches)
        out = fused(batch, k_caches, v_caches, lora)
        diffs.append(float((out - expected).abs().max()))
        return out

    engine.runner.fused = both
    engine.generate_batch(PROMPTS, SamplingParams(max_tokens=16, temperature=0))
    assert len(diffs) >= 12
    assert max(diffs) <= 1e-4


def test_int8_and_bf16_greedy_lookahead_matches_one_step_at_a_time(checkpoint, cpu_kernels):
    """Multi-step greedy decoding in C gives the tokens of single steps, for both kinds of weights."""
    for dtype in ("int8", "bfloat16"):
        outputs = []
        for lookahead in (1, 8):
            engine = LLMEngine(load_model(checkpoint, dtype), byte_tokenizer(),
                               EngineConfig(block_size=4, max_lookahead=lookahead))
            assert engine.runner.fused is not None
            outputs.append([r[1] for r in engine.generate_batch(PROMPTS, SamplingParams(max_tokens=24,
                                                                                          temperature=0))])
        assert outputs[0] == outputs[1], dtype
