"""How the denoiser's passes combine into one guided prediction: classifier-free guidance and Perp-Neg.

- ``cfg`` (Ho & Salimans 2022, "Classifier-Free Diffusion Guidance"): out_u + w (out_p − out_u), where out_u is the
  unconditional pass. A negative prompt takes the empty caption's place as out_u, so the step follows
  (prompt − negative): whatever the two share cancels and the rest is extrapolated ("yellow minus green is red").
- ``perp_neg`` (Armandpour et al. 2023, "Re-imagine the Negative Prompt Algorithm: Transform 2D Diffusion into 3D,
  alleviate Janus problem and Beyond", arXiv:2304.04968, eq. 6–7): out_u stays the empty caption's pass, and the
  negative's direction d_n = out_n − out_u is subtracted only for its part orthogonal to the prompt's direction
  d_p = out_p − out_u, so the negative removes what it adds beyond the prompt and never pushes against the prompt:
  out = out_u + w (d_p − w_n d_n⊥), d_n⊥ = d_n − (⟨d_n, d_p⟩ / ‖d_p‖²) d_p, per sample.

The projection is the same for ε- and v-prediction: at one step every pass sees the same x_t, and v = ε/α − (σ/α)
x_t, so the directions d differ between the two only by the factor 1/α and their angles are unchanged.
"""

from __future__ import annotations

import torch

from genserve.services.diffusion.params import DEFAULT_NEGATIVE_WEIGHT

# ‖d_p‖² below this (per element, squared) counts as zero: nothing to project onto, so d_n is subtracted whole.
_TINY = 1e-12


def cfg(uncond: torch.Tensor, cond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance: uncond + w (cond − uncond); ``uncond`` is the negative prompt's pass if given."""
    return uncond + guidance_scale * (cond - uncond)


def perpendicular(d_n: torch.Tensor, d_p: torch.Tensor) -> torch.Tensor:
    """d_n minus its projection on d_p, per sample (dim 0); both (N, ...). Zero d_p leaves d_n unchanged."""
    flat_n, flat_p = d_n.flatten(1), d_p.flatten(1)  # (N, D)
    dot = (flat_n * flat_p).sum(1)
    norm2 = (flat_p * flat_p).sum(1)
    coefficient = torch.where(norm2 > _TINY * flat_p.shape[1], dot / norm2.clamp_min(_TINY), torch.zeros_like(dot))
    return d_n - coefficient.view(-1, *([1] * (d_n.dim() - 1))) * d_p


def perp_neg(uncond: torch.Tensor, cond: torch.Tensor, negative: torch.Tensor, guidance_scale: float,
             negative_weight: float = DEFAULT_NEGATIVE_WEIGHT) -> torch.Tensor:
    """Perp-Neg: uncond + w (d_p − w_n d_n⊥) with d_p = cond − uncond and d_n = negative − uncond (all (N, ...))."""
    d_p = cond - uncond
    return uncond + guidance_scale * (d_p - negative_weight * perpendicular(negative - uncond, d_p))


def combine(out: torch.Tensor, passes: int, guidance_scale: float, mode: str,
            negative_weight: float = DEFAULT_NEGATIVE_WEIGHT) -> torch.Tensor:
    """The guided prediction from one U-Net output of ``passes`` blocks of N rows (prompts, unconditional input,
    then negatives): 1 is the prompts alone, 2 classifier-free guidance, 3 Perp-Neg."""
    if passes == 1:
        return out
    if passes == 2:
        cond, uncond = out.chunk(2)
        return cfg(uncond, cond, guidance_scale)
    if mode != "perp_neg" or passes != 3:
        raise ValueError(f"context must hold 2N rows, or 3N under perp_neg; got {passes}N with {mode!r}")
    cond, uncond, negative = out.chunk(3)
    return perp_neg(uncond, cond, negative, guidance_scale, negative_weight)
