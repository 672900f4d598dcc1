"""KV-cache memory (Remark 11, "KV Cache Memory Budget", and Exercise 13 of the chapter
"Deep Learning Building Blocks")."""

from __future__ import annotations

import pytest

from genserve.shared.blocks.kv_cache import kv_cache_bytes

GiB = 2**30


def test_remark_11_llama_70b_mha_vs_gqa() -> None:
    """L = 80, h = 64, d_k = 128, n = 4096, FP16: 2 L h d_k n = 5.4e9 values ~ 10 GB; GQA with 8 KV heads ~ 1.25 GB."""
    mha = kv_cache_bytes(80, 4096, n_kv_heads=64, head_dim=128)
    gqa = kv_cache_bytes(80, 4096, n_kv_heads=8, head_dim=128)
    assert mha // 2 == 2 * 80 * 64 * 128 * 4096 == 5_368_709_120  # values
    assert mha / GiB == pytest.approx(10.0)
    assert gqa / GiB == pytest.approx(1.25)
    assert mha / gqa == 8


def test_exercise_13_mha_gqa_mla() -> None:
    """L = 32, h = 32, d_k = 128, n = 8192, FP16: (a) 4 GiB, (b) GQA with 4 groups 0.5 GiB, (c) MLA d_c = 512."""
    assert kv_cache_bytes(32, 8192, n_kv_heads=32, head_dim=128) / GiB == pytest.approx(4.0)
    assert kv_cache_bytes(32, 8192, n_kv_heads=4, head_dim=128) / GiB == pytest.approx(0.5)
    assert kv_cache_bytes(32, 8192, latent_dim=512) / GiB == pytest.approx(0.25)  # L d_c n values, no factor 2
    # DeepSeek-V2's decoupled RoPE key adds d_rope = 64 values per token
    assert kv_cache_bytes(32, 8192, latent_dim=512, rope_dim=64) == 32 * 576 * 8192 * 2


def test_batch_and_dtype_scale_linearly_and_arguments_are_checked() -> None:
    one = kv_cache_bytes(2, 10, n_kv_heads=2, head_dim=4)
    assert kv_cache_bytes(2, 10, n_kv_heads=2, head_dim=4, batch_size=3, bytes_per_value=4) == one * 6
    with pytest.raises(ValueError):
        kv_cache_bytes(2, 10, n_kv_heads=2)
    with pytest.raises(ValueError):
        kv_cache_bytes(2, 10, n_kv_heads=2, head_dim=4, latent_dim=8)
