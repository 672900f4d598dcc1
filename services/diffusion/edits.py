"""Image-to-image and inpainting: denoising that starts from a given image instead of pure noise.

Image-to-image (SDEdit; Meng et al. 2022, "SDEdit: Guided Image Synthesis and Editing with Stochastic Differential
Equations", §3): encode the image, noise its latents to the level of an intermediate step and run only the remaining
steps. ``strength`` s ∈ (0, 1] is the fraction of the schedule that runs: s = 1 starts from (almost) pure noise,
small s stays close to the image. Which step that is follows diffusers: ⌊n s⌋ steps for Stable Diffusion, n s
(floored after the subtraction) for the flow-matching pipelines.

Inpainting with a regular U-Net (the latent blending of Avrahami et al. 2023, "Blended Latent Diffusion", §3.1, as
diffusers' StableDiffusionInpaintPipeline does it): after every step the latents outside the mask are replaced by the
image's own latents noised to the next step's level, so only the masked region (mask 1 = repaint) is generated.

The random numbers come from the request's generator in diffusers' order: the image's posterior sample, then the
noise, then (inpainting) the masked image's posterior sample, so a seed gives diffusers' image.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from genserve.services.diffusion.flow_match import FlowMatchEulerScheduler
from genserve.services.diffusion.schedulers.euler import EulerDiscreteScheduler


@dataclass(frozen=True)
class Posterior:
    """The VAE's encoding of the init image: N(mean, exp(logvar)), each (1 or N, C, h, w), un-scaled."""

    mean: torch.Tensor
    logvar: torch.Tensor

    def sample(self, generator: torch.Generator) -> torch.Tensor:
        """mean + σ ε with ε from ``generator`` (diffusers' DiagonalGaussianDistribution.sample)."""
        eps = torch.randn(self.mean.shape, generator=generator).to(self.mean.device)
        return self.mean + torch.exp(0.5 * self.logvar.clamp(-30.0, 20.0)) * eps


@dataclass
class Inpainting:
    """What the blending after each step needs: the image's scaled latents, the noise drawn for them, and the mask
    at latent size (N, 1, h, w), 1 where the image is repainted."""

    image_latents: torch.Tensor
    noise: torch.Tensor
    mask: torch.Tensor
    # A 9-channel inpainting U-Net reads (mask, masked image's latents) beside the latents and is not blended.
    masked_latents: torch.Tensor | None = None

    def condition(self, x: torch.Tensor) -> torch.Tensor:
        """The U-Net input: x (N, C, h, w), with the mask and the masked image's latents for a 9-channel U-Net."""
        return x if self.masked_latents is None else torch.cat([x, self.mask, self.masked_latents], dim=1)

    def blend(self, sampler, latents: torch.Tensor, next_index: int, steps: int) -> torch.Tensor:
        """Keep the generated latents inside the mask and the image's, noised to step ``next_index``, outside."""
        if self.masked_latents is not None:
            return latents
        proper = self.image_latents
        if next_index < steps:
            proper = add_noise(sampler, proper, self.noise, next_index)
        return (1 - self.mask) * proper + self.mask * latents


def start_index(steps: int, strength: float, flow: bool) -> int:
    """The first of ``steps`` steps an edit of this strength runs (diffusers' get_timesteps per pipeline family)."""
    if not 0.0 < strength <= 1.0:
        raise ValueError(f"strength must be in (0, 1], got {strength}")
    if flow:
        return int(max(steps - min(steps * strength, steps), 0))
    return max(steps - min(int(steps * strength), steps), 0)


def add_noise(sampler, x0: torch.Tensor, noise: torch.Tensor, index: int) -> torch.Tensor:
    """x_0 noised to the level of the sampler's step ``index``: (1 − σ) x_0 + σ ε for flow matching, x_0 + σ ε for
    Euler's σ-space sample, √ᾱ_t x_0 + √(1 − ᾱ_t) ε for the variance-preserving samplers (DDPM Eq. 4)."""
    if isinstance(sampler, FlowMatchEulerScheduler):
        return sampler.scale_noise(x0, noise, index)
    if isinstance(sampler, EulerDiscreteScheduler):
        return x0 + sampler.sigmas[index].to(x0.device) * noise
    abar = sampler.alphas_cumprod[int(sampler.timesteps[index])].to(x0.device, x0.dtype)
    return abar.sqrt() * x0 + (1 - abar).sqrt() * noise


def latent_mask(mask: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
    """A pixel mask (N, 1, H, W) in [0, 1] -> (N, 1, h, w) of 0/1: binarised at 0.5, then resized by nearest
    neighbour to the latent grid (diffusers' mask processor and prepare_mask_latents)."""
    binary = (mask >= 0.5).to(mask.dtype)
    return F.interpolate(binary, size=latent_hw)
