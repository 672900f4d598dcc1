"""genserve.kernels.mla_decode_attention (MLA's absorbed decode over its paged latent cache) against the reference
backend's paged decode with the cache as keys and as values, its first d_c columns kept: block tables with holes and
a shared prefix, head counts that leave a partial head block, widths padded on each side, split-K, a window, and
DeepSeek-V3's own 512 + 64 wide entries (past the generic kernels' 256)."""

from __future__ import annotations

import math

import pytest
import torch

from genserve.kernels.mla_decode import mla_decode_attention
from genserve.shared.blocks.backend import get_backend

TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 4e-2}
BLOCK_SIZE = 16
NUM_BLOCKS = 40


def _latent_batch(context_lens: list[int], heads: int, latent: int, rope: int, dtype: torch.dtype):
    """Blocks handed out in random order, sequence 1 sharing sequence 0's first block, unused entries -1."""
    gen = torch.Generator().manual_seed(len(context_lens) * heads + latent)
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, 1, latent + rope, generator=gen).to(dtype)
    max_blocks = max(-(-n // BLOCK_SIZE) for n in context_lens) + 1
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    for b, n in enumerate(context_lens):
        for i in range(-(-n // BLOCK_SIZE)):
            tables[b, i] = tables[0, i] if b == 1 and i == 0 else free.pop()
    q = torch.randn(len(context_lens), heads, latent + rope, generator=gen).to(dtype)
    return q, cache, tables, torch.tensor(context_lens, dtype=torch.int32)


def _reference(q, cache, tables, lens, latent: int, sm_scale: float, window: int = 0) -> torch.Tensor:
    c = cache.float()
    out = get_backend("reference").paged_decode(q.float(), c, c, tables, lens, sm_scale=sm_scale, window=window)
    return out[..., :latent]


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_mla_decode_matches_the_reference(dtype) -> None:
    q, cache, tables, lens = _latent_batch([100, 45, 1], heads=20, latent=40, rope=8, dtype=dtype)
    scale = 1 / math.sqrt(24)
    out = mla_decode_attention(q, cache, tables, lens, latent_dim=40, sm_scale=scale)
    assert out.shape == (3, 20, 40) and out.dtype == dtype
    assert (out.float() - _reference(q, cache, tables, lens, 40, scale)).abs().max().item() <= TOLERANCES[dtype]


def test_mla_decode_split_k_and_window_match_the_reference() -> None:
    q, cache, tables, lens = _latent_batch([300, 40, 17], heads=16, latent=24, rope=8, dtype=torch.float32)
    scale = 0.2
    split = mla_decode_attention(q, cache, tables, lens, latent_dim=24, sm_scale=scale, num_splits=2)
    assert (split - _reference(q, cache, tables, lens, 24, scale)).abs().max().item() <= 2e-5
    windowed = mla_decode_attention(q, cache, tables, lens, latent_dim=24, sm_scale=scale, window=37)
    assert (windowed - _reference(q, cache, tables, lens, 24, scale, window=37)).abs().max().item() <= 2e-5


def test_mla_decode_takes_deepseek_v3s_576_wide_entries() -> None:
    q, cache, tables, lens = _latent_batch([40, 9], heads=16, latent=512, rope=64, dtype=torch.float32)
    scale = 1 / math.sqrt(192)
    out = mla_decode_attention(q, cache, tables, lens, latent_dim=512, sm_scale=scale)
    assert (out - _reference(q, cache, tables, lens, 512, scale)).abs().max().item() <= 2e-5


def test_mla_decode_refuses_inputs_it_cannot_read_naming_them() -> None:
    q, cache, tables, lens = _latent_batch([5], heads=4, latent=16, rope=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="latent_dim"):
        mla_decode_attention(q, cache, tables, lens, latent_dim=24)
    with pytest.raises(ValueError, match="cache"):
        mla_decode_attention(q, cache.expand(-1, -1, 2, -1), tables, lens, latent_dim=16)
    with pytest.raises(ValueError, match="dtype"):
        mla_decode_attention(q.double(), cache, tables, lens, latent_dim=16)
