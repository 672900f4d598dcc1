"""Algorithm 3 ("Flash Attention (Simplified)") of the chapter "Deep Learning Building Blocks" (tiled attention with the
online softmax) equals standard softmax attention (Def. 12, "Scaled Dot-Product Attention")."""

from __future__ import annotations

import math

import pytest
import torch

from genserve.shared.blocks.masks import causal_mask
from genserve.shared.blocks.tiled_attention import tiled_attention


def _standard(q, k, v, causal: bool, sm_scale: float | None = None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d_k) + M) V with K/V heads repeated explicitly for GQA."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ k.transpose(-1, -2) * (sm_scale or 1 / math.sqrt(q.shape[-1]))
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2]), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


CASES = [
    # (Hq, Hkv, Nq, Nk, block_q, block_k, causal)
    (4, 4, 33, 33, 16, 16, False),
    (4, 4, 33, 33, 16, 16, True),
    (8, 2, 40, 40, 8, 16, True),  # GQA
    (4, 1, 17, 17, 16, 5, True),  # MQA, blocks that do not divide N
    (4, 2, 7, 30, 4, 8, True),  # chunked prefill: Nq < Nk, bottom-right causal
    (4, 2, 1, 30, 16, 16, True),  # a single decode query
    (2, 2, 12, 50, 16, 7, False),  # cross-attention-like, Nq != Nk
]


@pytest.mark.parametrize(("hq", "hkv", "nq", "nk", "bq", "bk", "causal"), CASES)
def test_tiled_equals_standard_softmax_attention(hq, hkv, nq, nk, bq, bk, causal) -> None:
    q = torch.randn(2, hq, nq, 16, dtype=torch.float64)
    k = torch.randn(2, hkv, nk, 16, dtype=torch.float64)
    v = torch.randn(2, hkv, nk, 16, dtype=torch.float64)
    out = tiled_attention(q, k, v, causal=causal, block_q=bq, block_k=bk)
    assert out.dtype == torch.float64  # accumulated in float32, returned in the input dtype
    assert torch.allclose(out, _standard(q, k, v, causal), atol=1e-5)


def test_online_softmax_is_stable_for_large_scores() -> None:
    """The running max keeps exp() finite where a naive exp(S) would overflow."""
    q = torch.randn(1, 2, 20, 8) * 100
    k = torch.randn(1, 2, 20, 8) * 100
    v = torch.randn(1, 2, 20, 8)
    out = tiled_attention(q, k, v, causal=True, block_q=4, block_k=4)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, _standard(q, k, v, True), atol=1e-4)


def test_custom_scale_and_value_width() -> None:
    q, k, v = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 5)
    out = tiled_attention(q, k, v, causal=False, sm_scale=0.3, block_q=4, block_k=4)
    assert torch.allclose(out, _standard(q, k, v, False, sm_scale=0.3), atol=1e-5)
