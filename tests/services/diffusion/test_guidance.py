"""The guidance arithmetic (services/diffusion/guidance.py) against values written out by hand."""

from __future__ import annotations

import torch

from genserve.services.diffusion.guidance import cfg, perp_neg, perpendicular


def _batch(*samples: list[float]) -> torch.Tensor:
    """Per-sample vectors as a (N, C, 1, 1) latent batch, the shape the U-Net's outputs have."""
    return torch.tensor(samples, dtype=torch.float64)[:, :, None, None]


def test_cfg_is_uncond_plus_scale_times_the_difference() -> None:
    # 1 + 2 (3 − 1) = 5, 2 + 2 (1 − 2) = 0
    out = cfg(_batch([1.0, 2.0]), _batch([3.0, 1.0]), 2.0)
    torch.testing.assert_close(out, _batch([5.0, 0.0]), rtol=0, atol=0)


def test_perpendicular_removes_the_projection_per_sample() -> None:
    # sample 0: d_p = (1, 1), d_n = (2, 0): ⟨d_n, d_p⟩ / ‖d_p‖² = 2 / 2 = 1, so d_n⊥ = (2, 0) − (1, 1) = (1, −1)
    # sample 1: d_p = (0, 2), d_n = (3, 4): 8 / 4 = 2, so d_n⊥ = (3, 4) − (0, 4) = (3, 0)
    d_n, d_p = _batch([2.0, 0.0], [3.0, 4.0]), _batch([1.0, 1.0], [0.0, 2.0])
    out = perpendicular(d_n, d_p)
    torch.testing.assert_close(out, _batch([1.0, -1.0], [3.0, 0.0]), rtol=0, atol=1e-12)
    assert torch.allclose((out * d_p).sum(dim=(1, 2, 3)), torch.zeros(2, dtype=torch.float64))


def test_perpendicular_to_a_zero_direction_is_the_whole_vector() -> None:
    d_n = _batch([2.0, -1.0])
    torch.testing.assert_close(perpendicular(d_n, torch.zeros_like(d_n)), d_n, rtol=0, atol=0)


def test_perp_neg_written_out() -> None:
    # eps = u + w (d_p − w_n d_n⊥), w = 2, w_n = 0.5
    # sample 0: u = (0, 0), p = (1, 1), n = (2, 0): d_p = (1, 1), d_n⊥ = (1, −1); 2 ((1, 1) − (0.5, −0.5)) = (1, 3)
    # sample 1: u = (1, 1), p = (1, 3), n = (4, 5): d_p = (0, 2), d_n = (3, 4), d_n⊥ = (3, 0);
    #           (1, 1) + 2 ((0, 2) − (1.5, 0)) = (−2, 5)
    uncond, cond, negative = _batch([0.0, 0.0], [1.0, 1.0]), _batch([1.0, 1.0], [1.0, 3.0]), _batch([2.0, 0.0],
                                                                                                   [4.0, 5.0])
    out = perp_neg(uncond, cond, negative, guidance_scale=2.0, negative_weight=0.5)
    torch.testing.assert_close(out, _batch([1.0, 3.0], [-2.0, 5.0]), rtol=0, atol=1e-12)


def test_perp_neg_with_w_n_one_written_out() -> None:
    # u = (0, 0), p = (1, 0), n = (2, 3): d_n⊥ = (0, 3); 3 ((1, 0) − (0, 3)) = (3, −9)
    out = perp_neg(_batch([0.0, 0.0]), _batch([1.0, 0.0]), _batch([2.0, 3.0]), guidance_scale=3.0)
    torch.testing.assert_close(out, _batch([3.0, -9.0]), rtol=0, atol=1e-12)


def test_a_negative_along_the_prompt_changes_nothing() -> None:
    """What the negative shares with the prompt is never subtracted: a parallel (or empty) negative gives plain
    classifier-free guidance with the empty caption."""
    uncond, cond = torch.randn(3, 4, 8, 8, dtype=torch.float64), torch.randn(3, 4, 8, 8, dtype=torch.float64)
    scale = torch.tensor([-0.5, 0.7, 2.0], dtype=torch.float64)[:, None, None, None]
    expected = cfg(uncond, cond, 4.0)
    torch.testing.assert_close(perp_neg(uncond, cond, uncond + scale * (cond - uncond), 4.0), expected)
    torch.testing.assert_close(perp_neg(uncond, cond, uncond, 4.0), expected, rtol=0, atol=0)


def test_cfg_with_the_negative_as_uncond_overshoots_where_perp_neg_does_not() -> None:
    """The issue's "yellow minus green": under cfg a negative sharing the prompt's direction cancels it."""
    uncond, cond = _batch([0.0, 0.0]), _batch([1.0, 1.0])
    negative = _batch([1.0, 0.0])  # half along the prompt, half across it
    torch.testing.assert_close(cfg(negative, cond, 3.0), _batch([1.0, 3.0]), rtol=0, atol=0)  # the shared part is gone
    # d_n⊥ = (1, 0) − 0.5 (1, 1) = (0.5, −0.5): 3 ((1, 1) − (0.5, −0.5)) = (1.5, 4.5), whose projection on d_p = (1, 1)
    # is 3 (1, 1): the prompt's direction keeps its full guidance
    torch.testing.assert_close(perp_neg(uncond, cond, negative, 3.0), _batch([1.5, 4.5]), rtol=0, atol=1e-12)
