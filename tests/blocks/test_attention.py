"""Attention of the chapter "Deep Learning Building Blocks" (Def. 12 "Scaled Dot-Product Attention", Def. 13
"Multi-Head Attention", Def. 17 "Multi-Query and Grouped-Query Attention", Def. 18 "Gated Attention", the chapter's
causal and cross-attention equations, and the cache of Def. 16 "KV Cache") checked against written-out formulas and
torch's SDPA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from genserve.shared.blocks.attention import MultiHeadAttention
from genserve.shared.blocks.backend import get_backend
from genserve.shared.blocks.cross_attention import ContextCache, CrossAttention
from genserve.shared.blocks.kv_cache import KVCache
from genserve.shared.blocks.masks import (
    causal_mask,
    padding_mask,
    prefix_bidirectional_mask,
    sliding_window_mask,
    to_additive,
)
from genserve.shared.blocks.rope import rope_cos_sin
from genserve.shared.blocks.sdpa import scaled_dot_product_attention

BACKENDS = ["reference", "torch"]


def _heads_attention(x: torch.Tensor, wq, wk, wv, wo, n_heads: int, kv_of_head) -> torch.Tensor:
    """Def. 13 ("Multi-Head Attention") literally: one softmax(Q_i K_g(i)^T / sqrt(d_k)) V_g(i) per head,
    concatenated, times W^O."""
    heads = []
    for i in range(n_heads):
        q, k, v = x @ wq[i].T, x @ wk[kv_of_head(i)].T, x @ wv[kv_of_head(i)].T
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        heads.append(torch.softmax(scores, dim=-1) @ v)
    return torch.cat(heads, dim=-1) @ wo.T


def _split(weight: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(weight.detach().chunk(n, dim=0))


def test_sdpa_matches_torch_and_the_definition() -> None:
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)
    expected = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1) @ v
    assert torch.allclose(scaled_dot_product_attention(q, k, v), expected, atol=1e-6)
    mask = torch.rand(2, 1, 5, 7) > 0.3
    mask[..., 0] = True
    assert torch.allclose(
        scaled_dot_product_attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-6
    )
    additive = scaled_dot_product_attention(q, k, v, to_additive(mask))
    assert torch.allclose(additive, scaled_dot_product_attention(q, k, v, mask), atol=1e-6)


def test_sdpa_groups_query_heads_without_copying_kv() -> None:
    """Query head i reads kv head i // (Hq / Hkv) (g(i) of Def. 17, "Multi-Query and Grouped-Query Attention")."""
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    out = scaled_dot_product_attention(q, k, v)
    for i in range(6):
        single = scaled_dot_product_attention(q[:, i : i + 1], k[:, i // 3 : i // 3 + 1], v[:, i // 3 : i // 3 + 1])
        assert torch.allclose(out[:, i : i + 1], single, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_with_g_equal_h_is_mha(backend: str) -> None:
    dim, h = 32, 4
    attn = MultiHeadAttention(dim, h, n_kv_heads=h, backend=get_backend(backend))
    x = torch.randn(2, 6, dim)
    wq, wk, wv = (_split(p.weight, h) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    expected = _heads_attention(x, wq, wk, wv, attn.o_proj.weight, h, kv_of_head=lambda i: i)
    assert torch.allclose(attn(x, causal=False), expected, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_with_g_equal_1_is_mqa(backend: str) -> None:
    """MQA: every head has its own W_i^Q but shares the single K = X W^K, V = X W^V."""
    dim, h = 32, 4
    attn = MultiHeadAttention(dim, h, n_kv_heads=1, backend=get_backend(backend))
    assert attn.k_proj.weight.shape == (dim // h, dim)
    x = torch.randn(2, 6, dim)
    wq = _split(attn.q_proj.weight, h)
    expected = _heads_attention(
        x, wq, [attn.k_proj.weight], [attn.v_proj.weight], attn.o_proj.weight, h, kv_of_head=lambda i: 0
    )
    assert torch.allclose(attn(x, causal=False), expected, atol=1e-5)


def test_gqa_shares_each_kv_head_within_its_group() -> None:
    """GQA equals MHA whose k/v weights repeat each kv head's weights for the heads of its group."""
    dim, h, g = 32, 8, 2
    gqa = MultiHeadAttention(dim, h, n_kv_heads=g, head_dim=4)
    mha = MultiHeadAttention(dim, h, n_kv_heads=h, head_dim=4)
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        for src, dst in ((gqa.k_proj, mha.k_proj), (gqa.v_proj, mha.v_proj)):
            dst.weight.copy_(src.weight.view(g, 1, 4, dim).expand(g, h // g, 4, dim).reshape(h * 4, dim))
    x = torch.randn(2, 5, dim)
    assert torch.allclose(gqa(x), mha(x), atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_kv_cache_incremental_decoding_equals_full_causal_forward(backend: str, n_kv_heads: int) -> None:
    dim, h, d, t = 32, 4, 8, 9
    attn = MultiHeadAttention(dim, h, n_kv_heads, bias=True, backend=get_backend(backend))
    rope = rope_cos_sin(d, 16)
    x = torch.randn(2, t, dim)
    full = attn(x, rope=rope, causal=True)
    cache = KVCache(2, 16, n_kv_heads, d)
    prefill = attn(x[:, :4], rope=rope, causal=True, kv_cache=cache)  # a 4-token prompt, then one token a step
    steps = [attn(x[:, i : i + 1], rope=rope, causal=True, kv_cache=cache) for i in range(4, t)]
    assert cache.length == t
    assert torch.allclose(torch.cat([prefill, *steps], dim=1), full, atol=1e-5)


def test_kv_cache_appends_rows_and_refuses_overflow() -> None:
    cache = KVCache(1, 3, 2, 4)
    k1, v1 = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    k, v = cache.append(k1, v1)
    assert torch.equal(k, k1) and torch.equal(v, v1)
    k2 = torch.randn(1, 2, 1, 4)
    k, _ = cache.append(k2, k2)
    assert torch.equal(k, torch.cat((k1, k2), dim=2))  # K_t = [K_{t-1}; k_t^T]
    with pytest.raises(ValueError, match="overflow"):
        cache.append(k2, k2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_future_tokens_never_change_past_outputs(backend: str) -> None:
    attn = MultiHeadAttention(32, 4, 2, backend=get_backend(backend))
    rope = rope_cos_sin(8, 16)
    x = torch.randn(1, 10, 32)
    y = x.clone()
    y[:, 6:] = torch.randn(1, 4, 32)
    out_x, out_y = attn(x, rope=rope), attn(y, rope=rope)
    assert torch.allclose(out_x[:, :6], out_y[:, :6], atol=1e-6)
    assert not torch.allclose(out_x[:, 6:], out_y[:, 6:], atol=1e-3)
    bidirectional = attn(y, rope=rope, causal=False)
    assert not torch.allclose(bidirectional[:, :6], out_x[:, :6], atol=1e-3)


def test_causal_mask_is_bottom_right_aligned() -> None:
    assert torch.equal(causal_mask(3), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    assert torch.equal(causal_mask(2, 4), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))
    additive = to_additive(causal_mask(2))
    assert additive[0, 1] == float("-inf") and additive[1, 0] == 0


def test_prefix_bidirectional_mask_glm_parts() -> None:
    """Part A (first 2 tokens) sees all of A; Part B sees A and the preceding B tokens."""
    expected = torch.tensor(
        [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(prefix_bidirectional_mask(2, 5), expected)
    batched = prefix_bidirectional_mask(torch.tensor([2, 0]), 5)
    assert batched.shape == (2, 1, 5, 5)
    assert torch.equal(batched[0, 0], expected) and torch.equal(batched[1, 0], causal_mask(5))


def test_prefix_mask_through_attention_makes_part_a_bidirectional() -> None:
    attn = MultiHeadAttention(16, 2)
    x = torch.randn(1, 6, 16)
    mask = prefix_bidirectional_mask(3, 6)
    out = attn(x, causal=False, attn_mask=mask)
    y = x.clone()
    y[:, 2] += 1.0  # change the last Part A token: every Part A output sees it
    out_y = attn(y, causal=False, attn_mask=mask)
    assert not torch.allclose(out[:, 0], out_y[:, 0], atol=1e-4)
    z = x.clone()
    z[:, 5] += 1.0  # change the last Part B token: nothing before it sees it
    assert torch.allclose(out[:, :5], attn(z, causal=False, attn_mask=mask)[:, :5], atol=1e-6)


def test_padding_and_sliding_window_masks() -> None:
    assert torch.equal(padding_mask(torch.tensor([2, 3]), 3)[:, 0, 0], torch.tensor([[1, 1, 0], [1, 1, 1]]).bool())
    window = sliding_window_mask(4, 4, 2)
    assert torch.equal(window, torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]).bool())


def test_gated_attention_multiplies_each_head_output_by_its_sigmoid_gate() -> None:
    """Def. 18 ("Gated Attention"): Y' = Y * sigmoid(X W_theta), elementwise on the concatenated head outputs, before
    W^O. Y is read off the same attention with W^O set to the identity."""
    gated = MultiHeadAttention(32, 4, 2, gated=True)
    heads = MultiHeadAttention(32, 4, 2)
    heads.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("gate_proj")})
    with torch.no_grad():
        heads.o_proj.weight.copy_(torch.eye(32))
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        y = heads(x)  # (B, T, H * D), the heads' outputs
        gate = torch.sigmoid(x @ gated.gate_proj.weight.T)
        expected = (y * gate) @ gated.o_proj.weight.T
        torch.testing.assert_close(gated(x), expected, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(gated(x), y @ gated.o_proj.weight.T, atol=1e-3)  # the gate did something


def test_gated_attention_scales_head_outputs_before_the_output_projection() -> None:
    """With W_theta = 0 the gate is 1/2 everywhere: the output equals plain attention with W^O halved."""
    plain = MultiHeadAttention(32, 4, 2)
    gated = MultiHeadAttention(32, 4, 2, gated=True)
    gated.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        gated.gate_proj.weight.zero_()
        plain.o_proj.weight.mul_(0.5)
    x = torch.randn(2, 5, 32)
    assert torch.allclose(gated(x), plain(x), atol=1e-6)
    assert gated.gate_proj.weight.shape == (32, 32)  # one d_k x d_k block per head


def test_attention_validates_head_counts() -> None:
    with pytest.raises(ValueError, match="n_kv_heads"):
        MultiHeadAttention(32, 4, 3)
    with pytest.raises(ValueError, match="head_dim"):
        MultiHeadAttention(30, 4)


def test_qwen2_style_qkv_bias_and_explicit_head_dim() -> None:
    attn = MultiHeadAttention(48, 4, 2, head_dim=16, bias=True)
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    assert attn.q_proj.weight.shape == (64, 48) and attn.k_proj.weight.shape == (32, 48)
    assert attn(torch.randn(1, 3, 48)).shape == (1, 3, 48)


def test_cross_attention_equation() -> None:
    """CrossAttn(X_img, X_txt) = softmax(Q_img K_txt^T / sqrt(d_k)) V_txt, per head, then to_out."""
    ca = CrossAttention(query_dim=16, context_dim=12, n_heads=2, head_dim=8)
    x, ctx = torch.randn(2, 5, 16), torch.randn(2, 3, 12)
    wq, wk, wv = (_split(p.weight, 2) for p in (ca.to_q, ca.to_k, ca.to_v))
    heads = []
    for i in range(2):
        s = (x @ wq[i].T) @ (ctx @ wk[i].T).transpose(-1, -2) / math.sqrt(8)
        heads.append(torch.softmax(s, dim=-1) @ (ctx @ wv[i].T))
    expected = ca.to_out[0](torch.cat(heads, dim=-1))
    assert torch.allclose(ca(x, ctx), expected, atol=1e-5)
    assert set(ca.state_dict()) == {"to_q.weight", "to_k.weight", "to_v.weight", "to_out.0.weight", "to_out.0.bias"}


def test_cross_attention_matches_diffusers_attention() -> None:
    from diffusers.models import attention_processor
    ref = attention_processor.Attention(query_dim=16, cross_attention_dim=12, heads=2, dim_head=8)
    ours = CrossAttention(16, 12, n_heads=2, head_dim=8)
    ours.load_state_dict(ref.state_dict())
    x, ctx = torch.randn(2, 5, 16), torch.randn(2, 3, 12)
    assert torch.allclose(ours(x, ctx), ref(x, encoder_hidden_states=ctx), atol=1e-5)
    ref_self = attention_processor.Attention(query_dim=16, heads=2, dim_head=8)  # context=None: self-attention
    ours_self = CrossAttention(16, None, n_heads=2, head_dim=8)
    ours_self.load_state_dict(ref_self.state_dict())
    assert torch.allclose(ours_self(x), ref_self(x), atol=1e-5)


def test_cross_attention_with_a_context_cache_equals_the_plain_context() -> None:
    ca = CrossAttention(16, 12, n_heads=2, head_dim=8)
    ctx = torch.randn(2, 3, 12)
    cache = ContextCache(ctx)
    for _ in range(3):  # the queries change every call; the text does not
        x = torch.randn(2, 5, 16)
        torch.testing.assert_close(ca(x, cache), ca(x, ctx), rtol=1e-6, atol=1e-6)


def test_context_cache_projects_keys_and_values_once_per_layer() -> None:
    layers = [CrossAttention(16, 12, n_heads=2, head_dim=8) for _ in range(2)]
    projections = []
    for layer in layers:
        for proj in (layer.to_k, layer.to_v):
            proj.register_forward_hook(lambda m, args, out: projections.append(m))
    cache = ContextCache(torch.randn(1, 4, 12))
    for _ in range(5):
        for layer in layers:
            layer(torch.randn(1, 6, 16), cache)
    assert projections == [layers[0].to_k, layers[0].to_v, layers[1].to_k, layers[1].to_v]


def test_exercise_11_scores_are_divided_by_sqrt_d_k() -> None:
    """softmax(Q K^T / sqrt(d_k)) V: with V the identity, the output IS the attention matrix, checked against the
    formula; with N(0, 1) entries the scaled scores keep variance ~1, while unscaled rows (variance d_k) go one-hot."""
    d_k, n = 64, 16
    q, k = torch.randn(1, 1, n, d_k, dtype=torch.float64), torch.randn(1, 1, n, d_k, dtype=torch.float64)
    weights = scaled_dot_product_attention(q, k, torch.eye(n, dtype=torch.float64)[None, None])
    expected = torch.softmax(q[0, 0] @ k[0, 0].T / math.sqrt(d_k), dim=-1)
    torch.testing.assert_close(weights[0, 0], expected, rtol=1e-5, atol=1e-6)  # the softmax runs in float32
    unscaled = torch.softmax(q[0, 0] @ k[0, 0].T, dim=-1)
    assert weights[0, 0].max(dim=-1).values.mean() < 0.5 < unscaled.max(dim=-1).values.mean()
