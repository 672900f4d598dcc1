"""genserve.kernels.apply_rope (Definition 15, "Rotary Position Embedding", of the chapter
"Deep Learning Building Blocks") against the blocks' RoPE, in both pairings, in place, in several layouts."""

from __future__ import annotations

import pytest
import torch

from genserve.kernels import apply_rope
from genserve.shared.blocks.rope import apply_rope as reference_rope
from genserve.shared.blocks.rope import rope_cos_sin

# Max abs error against the fp32 rotation of the same inputs: the kernel rotates in fp32 and rounds once.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}
MAX_POS = 64


def _tables(rotary_dim: int):
    return rope_cos_sin(rotary_dim, MAX_POS, theta=10000.0)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
def test_rope_matches_reference(interleaved, dtype) -> None:
    b, hq, hkv, t, d = 2, 4, 1, 9, 64
    q, k = torch.randn(b, hq, t, d, dtype=dtype), torch.randn(b, hkv, t, d, dtype=dtype)
    cos, sin = _tables(d)
    positions = torch.randint(0, MAX_POS, (b, t))
    ref_q, ref_k = reference_rope(q.float(), k.float(), cos, sin, positions, interleaved)
    out_q, out_k = apply_rope(q.clone(), k.clone(), cos, sin, positions, interleaved=interleaved)
    assert out_q.dtype == out_k.dtype == dtype
    assert (out_q.float() - ref_q.float()).abs().max().item() <= TOLERANCES[dtype]
    assert (out_k.float() - ref_k.float()).abs().max().item() <= TOLERANCES[dtype]


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
def test_rope_rotates_token_major_memory_in_place(interleaved) -> None:
    # (B, T, H, D) memory viewed as (B, H, T, D): the rotation must land in the caller's buffers.
    q_mem, k_mem = torch.randn(1, 11, 8, 128), torch.randn(1, 11, 2, 128)
    cos, sin = _tables(128)
    positions = torch.arange(5, 16)
    ref_q, ref_k = reference_rope(q_mem.transpose(1, 2), k_mem.transpose(1, 2), cos, sin, positions, interleaved)
    q, k = q_mem.transpose(1, 2), k_mem.transpose(1, 2)
    out_q, out_k = apply_rope(q, k, cos, sin, positions, interleaved=interleaved)
    assert out_q.data_ptr() == q_mem.data_ptr() and out_k.data_ptr() == k_mem.data_ptr()
    torch.testing.assert_close(q_mem.transpose(1, 2), ref_q)
    torch.testing.assert_close(k_mem.transpose(1, 2), ref_k)


def test_rope_packed_tokens_match_reference() -> None:
    q, k = torch.randn(13, 4, 32), torch.randn(13, 2, 32)  # (T, H, D)
    cos, sin = _tables(32)
    positions = torch.randint(0, MAX_POS, (13,))
    ref_q, ref_k = reference_rope(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin, positions)
    out_q, out_k = apply_rope(q.clone(), k.clone(), cos, sin, positions)
    torch.testing.assert_close(out_q, ref_q[0].transpose(0, 1))
    torch.testing.assert_close(out_k, ref_k[0].transpose(0, 1))


def test_rope_partial_rotary_leaves_the_tail_untouched() -> None:
    q, k = torch.randn(1, 2, 5, 64), torch.randn(1, 1, 5, 64)
    cos, sin = _tables(32)  # rotate the first 32 of 64 dims
    positions = torch.arange(5)
    ref_q, ref_k = reference_rope(q[..., :32], k[..., :32], cos, sin, positions)
    out_q, out_k = apply_rope(q.clone(), k.clone(), cos, sin, positions)
    torch.testing.assert_close(out_q[..., :32], ref_q)
    torch.testing.assert_close(out_k[..., :32], ref_k)
    assert torch.equal(out_q[..., 32:], q[..., 32:]) and torch.equal(out_k[..., 32:], k[..., 32:])


def test_rope_position_past_the_tables_reads_nothing() -> None:
    q, k = torch.randn(1, 2, 3, 32), torch.randn(1, 1, 3, 32)
    cos, sin = _tables(32)
    out_q, out_k = apply_rope(q.clone(), k.clone(), cos, sin, torch.tensor([0, MAX_POS, MAX_POS + 1000]))
    assert torch.equal(out_q[:, :, 0], q[:, :, 0]) and torch.equal(out_k[:, :, 0], k[:, :, 0])  # position 0: identity
    assert not out_q[:, :, 1:].any() and not out_k[:, :, 1:].any()


def test_rope_preserves_the_relative_position_property() -> None:
    # Proposition 1 ("Relative Position Property of RoPE"): the score of q at position m and k at position n
    # depends only on n - m.
    q, k = torch.randn(1, 1, 1, 64).expand(1, 1, 2, 64), torch.randn(1, 1, 1, 64).expand(1, 1, 2, 64)
    cos, sin = _tables(64)

    def score(m: int, n: int) -> torch.Tensor:
        rq, rk = apply_rope(q.clone(), k.clone(), cos, sin, torch.tensor([m, n]))
        return (rq[0, 0, 0] * rk[0, 0, 1]).sum()

    torch.testing.assert_close(score(3, 10), score(20, 27))
    assert not torch.allclose(score(3, 10), score(3, 11))
