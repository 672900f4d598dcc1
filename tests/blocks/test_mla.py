"""Multi-head latent attention (Def. 22, "Multi-Head Latent Attention (MLA)", of the chapter
"Deep Learning Building Blocks") with decoupled RoPE (Remark 17, "MLA in Practice")."""

from __future__ import annotations

import pytest
import torch

from genserve.shared.blocks.kv_cache import kv_cache_bytes
from genserve.shared.blocks.mla import LatentKVCache, MultiHeadLatentAttention
from genserve.shared.blocks.rope import rope_cos_sin

DIM, HEADS, D_C, D_NOPE, D_ROPE, D_V = 64, 4, 16, 8, 4, 8


def _mla(backend: str = "torch") -> MultiHeadLatentAttention:
    from genserve.shared.blocks.backend import get_backend

    return MultiHeadLatentAttention(DIM, HEADS, D_C, D_NOPE, D_ROPE, D_V, backend=get_backend(backend))


def test_cache_holds_only_the_latent_and_the_decoupled_rope_key() -> None:
    cache = LatentKVCache(2, 16, D_C, D_ROPE)
    shapes = {name: tuple(buf.shape) for name, buf in cache.named_buffers()}
    assert shapes == {"latent": (2, 16, D_C), "k_rope": (2, 16, D_ROPE)}
    per_token_values = sum(buf[0, 0].numel() for buf in cache.buffers())
    assert per_token_values == D_C + D_ROPE  # vs 2 * HEADS * (D_NOPE + D_ROPE) for MHA
    cache_bytes = sum(buf.numel() * 2 for buf in cache.buffers())  # as if FP16
    assert cache_bytes == kv_cache_bytes(1, 16, latent_dim=D_C, rope_dim=D_ROPE, batch_size=2)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_incremental_decoding_with_the_latent_cache_equals_full_forward(backend: str) -> None:
    mla = _mla(backend)
    rope = rope_cos_sin(D_ROPE, 32)
    x = torch.randn(2, 9, DIM)
    full = mla(x, rope=rope)
    cache = LatentKVCache(2, 32, D_C, D_ROPE)
    outs = [mla(x[:, :5], rope=rope, cache=cache)] + [mla(x[:, i : i + 1], rope=rope, cache=cache) for i in range(5, 9)]
    assert cache.length == 9
    assert torch.allclose(torch.cat(outs, dim=1), full, atol=1e-5)


def test_decoupled_rope_keeps_scores_relative() -> None:
    """Shifting every position by the same offset leaves the output unchanged
    (Prop. 1, "Relative Position Property of RoPE", through the rope part)."""
    mla = _mla()
    rope = rope_cos_sin(D_ROPE, 64)
    x = torch.randn(1, 6, DIM)
    a = mla(x, rope=rope, positions=torch.arange(6))
    b = mla(x, rope=rope, positions=torch.arange(30, 36))
    c = mla(x, rope=rope, positions=torch.tensor([0, 2, 4, 6, 8, 10]))
    assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(a, c, atol=1e-4)


def test_keys_and_values_are_rebuilt_from_the_latent() -> None:
    """k_t = W^UK c_t and v_t = W^UV c_t: zeroing the up-projection's value half zeroes the attention output."""
    mla = _mla()
    with torch.no_grad():
        mla.kv_b_proj.weight.view(HEADS, D_NOPE + D_V, D_C)[:, D_NOPE:].zero_()
    assert torch.allclose(mla(torch.randn(1, 4, DIM), rope=rope_cos_sin(D_ROPE, 8)), torch.zeros(1, 4, DIM))
    names = {n.split(".")[0] for n, _ in mla.named_parameters()}
    assert names == {"q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"}
