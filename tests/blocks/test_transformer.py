"""Transformer blocks: post-norm encoder (Algorithm 2, "Transformer Encoder Block", of the chapter
"Deep Learning Building Blocks"), pre-norm decoder, parallel block (Def. 21, "Parallel Transformer Block")."""

from __future__ import annotations

import pytest
import torch

from genserve.shared.blocks.ffn import GeluFFN, SwiGLU
from genserve.shared.blocks.moe import MoE
from genserve.shared.blocks.rope import rope_cos_sin
from genserve.shared.blocks.transformer import TransformerBlock, TransformerBlockConfig


def _block(**kw) -> TransformerBlock:
    return TransformerBlock(TransformerBlockConfig(dim=32, n_heads=4, n_kv_heads=2, **kw))


def test_post_norm_block_is_algorithm_2() -> None:
    b = _block(block="post_norm", norm="layernorm", ffn="gelu")
    x = torch.randn(2, 5, 32)
    h1 = b.input_layernorm(x + b.self_attn(x, causal=False))
    expected = b.post_attention_layernorm(h1 + b.mlp(h1))
    assert torch.allclose(b(x, causal=False), expected, atol=1e-6)
    assert isinstance(b.mlp, GeluFFN)


def test_pre_norm_block() -> None:
    b = _block()
    x = torch.randn(2, 5, 32)
    h = x + b.self_attn(b.input_layernorm(x))
    expected = h + b.mlp(b.post_attention_layernorm(h))
    assert torch.allclose(b(x), expected, atol=1e-6)
    assert isinstance(b.mlp, SwiGLU)


def test_parallel_block_feeds_both_branches_the_same_norm() -> None:
    """Def. 21 ("Parallel Transformer Block"): x' = x + Attn(Norm(x)) + FFN(Norm(x)); it differs from the
    sequential block with the same weights."""
    par = _block(block="parallel")
    assert par.post_attention_layernorm is None
    x = torch.randn(2, 5, 32)
    n = par.input_layernorm(x)
    assert torch.allclose(par(x), x + par.self_attn(n) + par.mlp(n), atol=1e-6)
    seq = _block(block="pre_norm")
    seq.load_state_dict(par.state_dict(), strict=False)
    assert not torch.allclose(seq(x), par(x), atol=1e-4)


def test_moe_and_gated_options_are_selected_by_config() -> None:
    b = _block(ffn="moe", n_experts=4, top_k=2, ffn_hidden_dim=16, gated_attention=True)
    assert isinstance(b.mlp, MoE) and b.self_attn.gate_proj is not None
    x = torch.randn(1, 3, 32)
    assert b(x, rope=rope_cos_sin(8, 8)).shape == (1, 3, 32)


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="block"):
        TransformerBlockConfig(dim=8, n_heads=2, block="sandwich")
    with pytest.raises(ValueError, match="top_k"):
        TransformerBlockConfig(dim=8, n_heads=2, ffn="moe", n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="norm"):
        TransformerBlockConfig(dim=8, n_heads=2, norm="batchnorm")


def test_pre_norm_block_matches_transformers_llama_decoder_layer() -> None:
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    ref = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    ours = _block(ffn_hidden_dim=64).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 7, 32)
    pos = torch.arange(7)[None].expand(2, 7)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos)
    causal = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    expected = ref(x, attention_mask=causal, position_ids=pos, position_embeddings=(cos, sin))
    expected = expected[0] if isinstance(expected, tuple) else expected
    assert torch.allclose(ours(x, rope=rope_cos_sin(8, 64)), expected, atol=1e-5)
