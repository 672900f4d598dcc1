"""Sinusoidal (Def. 14, "Sinusoidal Positional Encoding", of the chapter "Deep Learning Building Blocks"), learned and
timestep embeddings."""

from __future__ import annotations

import math

import pytest
import torch

from genserve.shared.blocks.positions import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    TimestepEmbedding,
    sinusoidal_positions,
    timestep_embedding,
)


def test_sinusoidal_encoding_follows_definition_14() -> None:
    d = 8
    pe = sinusoidal_positions(10, d)
    for pos in (0, 3, 9):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert math.isclose(pe[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-6)
            assert math.isclose(pe[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-6)
    x = torch.zeros(2, 4, d)
    assert torch.equal(SinusoidalPositionalEncoding(d, 10)(x, offset=3), pe[3:7].expand(2, 4, d))


def test_learned_positions_add_a_trainable_table() -> None:
    emb = LearnedPositionalEmbedding(4, 6)
    x = torch.randn(1, 3, 4)
    assert torch.equal(emb(x, offset=2), x + emb.weight[2:5])
    with pytest.raises(ValueError, match="max_len"):
        emb(torch.randn(1, 5, 4), offset=2)


@pytest.mark.parametrize(("flip", "shift"), [(True, 0.0), (False, 1.0)])
def test_timestep_embedding_matches_diffusers(flip: bool, shift: float) -> None:
    from diffusers.models import embeddings
    t = torch.tensor([0.0, 1.0, 250.5, 999.0])
    ref = embeddings.get_timestep_embedding(t, 32, flip_sin_to_cos=flip, downscale_freq_shift=shift)
    ours = timestep_embedding(t, 32, flip_sin_to_cos=flip, downscale_freq_shift=shift)
    assert torch.allclose(ours, ref, atol=1e-5)
    assert timestep_embedding(t, 33).shape == (4, 33)


def test_timestep_mlp_matches_diffusers_names() -> None:
    from diffusers.models import embeddings
    ref = embeddings.TimestepEmbedding(32, 64)
    ours = TimestepEmbedding(32, 64)
    ours.load_state_dict(ref.state_dict())
    feats = timestep_embedding(torch.tensor([3.0, 700.0]), 32)
    assert torch.allclose(ours(feats), ref(feats), atol=1e-6)
