"""A text model whose projections and LM head keep GGUF-quantised blocks (QuantLinear): the CPU runner's fused decode
step reads them in C and gives what the module path gives, and the engine's greedy tokens equal those of the same
model with the blocks dequantised to fp32 weights."""

from __future__ import annotations

import pytest
import torch
from text_helpers import hf_model, make_engine, save_hf
from torch import nn

from genserve.services.text.engine.params import SamplingParams
from genserve.shared.blocks.quant_linear import QuantLinear

QTYPES = {"q_proj": "Q4_1", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q4_1", "gate_proj": "Q4_0",
          "up_proj": "Q4_1", "down_proj": "Q8_0", "lm_head": "Q8_0"}
PROMPTS = [list(range(1, 20)), list(range(40, 45)), list(range(100, 131))]


def _quantize_(module: nn.Module) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, QuantLinear.from_linear(child, QTYPES[name], backend=child.backend))
        else:
            _quantize_(child)


def _dequantize_(module: nn.Module) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, QuantLinear):
            dense = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
            dense.weight.data, dense.bias = child.dequantized_weight(), child.bias
            setattr(module, name, dense)
        else:
            _dequantize_(child)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def directory(request, tmp_path_factory):
    torch.manual_seed(0)
    overrides = {"tie_word_embeddings": True} if request.param == "qwen2" else {}
    return save_hf(hf_model(request.param, **overrides), tmp_path_factory.mktemp(request.param), sharded=False)


def test_fused_decode_step_with_quantised_weights_matches_forward_paged(directory, cpu_kernels):
    engine = make_engine(directory, block_size=4, max_lookahead=1)
    _quantize_(engine.model)
    engine.runner.__init__(engine.model, max_lookahead=1)  # the runner decides on the model it will run
    engine.runner.allocate_kv_cache(engine.blocks.num_blocks, 4)
    fused = engine.runner.fused
    assert fused is not None and isinstance(engine.model.lm_head, QuantLinear)
    diffs: list[float] = []

    def both(batch, k_caches, v_caches, lora=None):
        reference = engine.model.forward_paged(batch, k_caches, v_caches)
        out = fused(batch, k_caches, v_caches, lora)
        diffs.append(float((out - reference).abs().max()))
        return out

    engine.runner.fused = both
    engine.generate_batch(PROMPTS, SamplingParams(max_tokens=16, temperature=0))
    assert len(diffs) >= 12 and max(diffs) <= 1e-4


def test_quantised_engine_generates_the_tokens_of_its_dequantised_weights(directory, cpu_kernels):
    quant, dense = make_engine(directory, block_size=4), make_engine(directory, block_size=4)
    for engine, convert in ((quant, _quantize_), (dense, lambda m: (_quantize_(m), _dequantize_(m)))):
        convert(engine.model)
        engine.runner.__init__(engine.model, max_lookahead=engine.runner.max_lookahead)
        engine.runner.allocate_kv_cache(engine.blocks.num_blocks, 4)
        assert engine.runner.fused is not None
    greedy = SamplingParams(max_tokens=24, temperature=0)
    tokens = [[r[1] for r in engine.generate_batch(PROMPTS, greedy)] for engine in (quant, dense)]
    assert tokens[0] == tokens[1]
