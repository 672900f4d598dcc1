"""RoPE (Def. 15, "Rotary Position Embedding", of the chapter "Deep Learning Building Blocks"): Prop. 1
("Relative Position Property of RoPE"), the chapter's Exercise 12, both pairing conventions, 2-D RoPE, and parity with
transformers' LlamaRotaryEmbedding for every scaling type (transformers is a test-only reference)."""

from __future__ import annotations

import math

import pytest
import torch

from genserve.shared.blocks.rope import (
    RoPE,
    RopeScaling,
    apply_rope,
    rope_2d,
    rope_cos_sin,
    rope_inv_freq,
    rope_matrix,
    scaled_inv_freq,
)


def _rotate(x: torch.Tensor, pos: int, interleaved: bool, head_dim: int) -> torch.Tensor:
    cos, sin = rope_cos_sin(head_dim, torch.tensor([pos]))
    q, _ = apply_rope(x[None, None, None], x[None, None, None], cos, sin, interleaved=interleaved)
    return q[0, 0, 0]


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotated_score_depends_only_on_relative_position(interleaved: bool) -> None:
    """Prop. 1 ("Relative Position Property of RoPE"): q~_m . k~_n = q_m^T R_{n-m} k_n, so shifting both positions
    leaves the score unchanged."""
    d = 16
    for _ in range(5):
        q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
        m, n, shift = (int(v) for v in torch.randint(0, 500, (3,)))
        score = _rotate(q, m, interleaved, d) @ _rotate(k, n, interleaved, d)
        shifted = _rotate(q, m + shift, interleaved, d) @ _rotate(k, n + shift, interleaved, d)
        assert torch.allclose(score.double(), shifted.double(), atol=1e-3)
        if interleaved:  # the chapter's block-diagonal layout: compare with q^T R_{n-m} k written as a matrix
            expected = q @ rope_matrix(d, n - m) @ k
            assert torch.allclose(score.double(), expected, atol=1e-3)


def test_exercise_12_rotation_matrices_compose() -> None:
    """d_k = 4, base 10000: theta_1 = 1, theta_2 = 0.01, and R_3^T R_5 = R_2."""
    assert torch.allclose(rope_inv_freq(4).double(), torch.tensor([1.0, 0.01], dtype=torch.float64))
    r3, r5, r2 = rope_matrix(4, 3), rope_matrix(4, 5), rope_matrix(4, 2)
    assert torch.allclose(r3[0, 0], torch.tensor(math.cos(3.0), dtype=torch.float64))
    assert torch.allclose(r3[2, 3], torch.tensor(-math.sin(0.03), dtype=torch.float64))
    assert torch.allclose(r3.T @ r5, r2, atol=1e-12)
    assert torch.allclose(r3.T @ r3, torch.eye(4, dtype=torch.float64), atol=1e-12)  # orthogonal


def test_interleaved_matches_the_dense_rotation_matrix() -> None:
    d, m = 8, 7
    x = torch.randn(d, dtype=torch.float64)
    assert torch.allclose(_rotate(x, m, True, d).double(), rope_matrix(d, m) @ x, atol=1e-6)


def test_rotate_half_is_interleaved_on_permuted_dims() -> None:
    """The HF convention pairs (x_i, x_{i+d/2}); permuting dims into adjacent pairs gives the interleaved result."""
    d = 8
    x = torch.randn(2, 3, 5, d)
    cos, sin = rope_cos_sin(d, 5)
    perm = torch.stack((torch.arange(d // 2), torch.arange(d // 2) + d // 2), dim=-1).flatten()  # 0,4,1,5,...
    half, _ = apply_rope(x, x, cos, sin)
    inter, _ = apply_rope(x[..., perm], x[..., perm], cos, sin, interleaved=True)
    assert torch.allclose(half[..., perm], inter, atol=1e-6)


def test_positions_gather_rows_of_the_table() -> None:
    rope = RoPE(16, 64)
    q, k = torch.randn(2, 4, 3, 16), torch.randn(2, 1, 3, 16)
    pos = torch.tensor([[5, 6, 7], [40, 41, 42]])
    q1, k1 = rope(q, k, pos)
    cos, sin = rope.tables()
    q2, _ = apply_rope(q[1:], k[1:], cos[40:43], sin[40:43])
    assert torch.allclose(q1[1:], q2)
    q3, _ = apply_rope(q, k, cos, sin)  # no positions: rows 0..T-1 of a longer table
    assert torch.allclose(q3, apply_rope(q, k, cos, sin, torch.arange(3))[0])
    assert k1.shape == k.shape


def test_rope_2d_scores_depend_only_on_grid_offsets() -> None:
    d, h, w = 16, 4, 5
    cos, sin = rope_2d(d, h, w)
    assert cos.shape == (h * w, d // 2)
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    qs, ks = apply_rope(q.expand(1, 1, h * w, d), k.expand(1, 1, h * w, d), cos, sin)
    scores = qs[0, 0] @ ks[0, 0].T  # (HW, HW)

    def idx(r: int, c: int) -> int:
        return r * w + c

    assert torch.allclose(scores[idx(0, 0), idx(1, 2)], scores[idx(2, 1), idx(3, 3)], atol=1e-5)
    assert not torch.allclose(scores[idx(0, 0), idx(1, 2)], scores[idx(0, 0), idx(2, 1)], atol=1e-3)


HF_CASES = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
]  # fmt: skip


@pytest.mark.parametrize("scaling", HF_CASES, ids=lambda s: s["rope_type"] if s else "default")
def test_matches_transformers_llama_rotary_embedding(scaling: dict | None) -> None:
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, max_pos, theta = 32, 256, 500000.0
    params = {"rope_type": "default", "rope_theta": theta} if scaling is None else {"rope_theta": theta, **scaling}
    cfg = transformers.LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=max_pos, rope_parameters=params
    )
    n = 300 if scaling and scaling["rope_type"] == "dynamic" else max_pos  # dynamic only differs past max_pos
    pos = torch.arange(n)
    hf_cos, hf_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1), pos[None])
    cos, sin = rope_cos_sin(head_dim, n, theta, RopeScaling.from_hf(scaling, max_pos))
    assert torch.equal(hf_cos[0], torch.cat((cos, cos), -1))
    assert torch.equal(hf_sin[0], torch.cat((sin, sin), -1))

    q, k = torch.randn(1, 4, n, head_dim), torch.randn(1, 2, n, head_dim)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    my_q, my_k = apply_rope(q, k, cos, sin, pos)
    assert torch.allclose(my_q, hf_q, atol=1e-6) and torch.allclose(my_k, hf_k, atol=1e-6)


def test_scaling_validation() -> None:
    with pytest.raises(ValueError, match="type"):
        RopeScaling(type="bogus", factor=2.0)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RopeScaling(type="yarn", factor=2.0)
    assert RopeScaling.from_hf({"type": "linear", "factor": 2.0}) == RopeScaling(type="linear", factor=2.0)
    assert RopeScaling.from_hf({"rope_type": "default", "rope_theta": 1e6}) is None


def test_ntk_and_linear_scaling_stretch_wavelengths() -> None:
    """Linear interpolation divides every frequency by the factor; NTK keeps the highest frequency and scales the
    lowest by exactly 1/factor (base' = base * s^{d/(d-2)})."""
    d, s = 16, 4.0
    base = rope_inv_freq(d)
    cos_lin, sin_lin = rope_cos_sin(d, torch.tensor([1]), scaling=RopeScaling("linear", s))
    assert torch.allclose(torch.atan2(sin_lin[0], cos_lin[0]), base / s, rtol=1e-5)
    ntk, factor = scaled_inv_freq(d, 10000.0, RopeScaling("ntk", s))
    assert factor == 1.0 and ntk[0] == 1.0
    assert torch.allclose(ntk[-1], base[-1] / s, rtol=1e-5)
