"""What the pipeline runs, whatever checkpoint it came from: the demo model (services/diffusion/model.py), a
Stable-Diffusion-format diffusers folder (services/diffusion/sd_folder.py) or an SD3-format one
(services/diffusion/sd3_folder.py) all load into these parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from genserve.services.diffusion.flow_match import FlowMatchConfig
from genserve.services.diffusion.params import DEFAULT_NEGATIVE_WEIGHT
from genserve.services.diffusion.schedulers.schedule import NoiseScheduleConfig
from genserve.shared.blocks.cross_attention import ContextCache


@dataclass(frozen=True)
class DiffusionComponents:
    # The denoiser: a U-Net (shared/blocks/unet.py) or a diffusion transformer (services/diffusion/mmdit.py), each
    # called as (latents, timesteps, context, temb=...) and with time_embed(timesteps, dtype).
    unet: nn.Module
    text_encoder: nn.Module  # ids (B, T) -> (B, T, cross_attention_dim); or the DiT's encoders (see conditioning)
    tokenizer: Callable[[list[str]], torch.Tensor]  # prompts -> ids (B, T)
    # The noise schedule each sampler name runs with (a diffusers folder's scheduler_config.json reads per sampler).
    schedule: Callable[[str], NoiseScheduleConfig]
    latent_channels: int
    # The model's native image size in pixels (height, width), and how many pixels one latent cell covers.
    native_size: tuple[int, int]
    vae_scale_factor: int
    # Latents are multiplied by this before diffusion and divided after (Rombach et al. 2022 §4.3.2).
    scaling_factor: float
    # width × height at most this many pixels; the demo model serves only its native size.
    max_pixels: int
    default_scheduler: str = "ddim"
    # "demo": w = 1 runs the conditional half only, w = 0 the unconditional; "diffusers": guidance only for w > 1,
    # as StableDiffusionPipeline does (its do_classifier_free_guidance).
    # "embedded": a guidance-distilled model (Flux) reads the scale as an input; one pass, never a second.
    guidance: Literal["demo", "diffusers", "embedded"] = "demo"
    # The guidance mode (services/diffusion/guidance.py) a request without one gets; "cfg" is diffusers' own.
    default_guidance: Literal["cfg", "perp_neg"] = "cfg"
    # Perp-Neg's w_n when a request sets none (1 is the paper's; the demo model's is measured, docs/models.md).
    default_negative_weight: float = DEFAULT_NEGATIVE_WEIGHT
    # un-scaled latents (N, C, h, w) -> a coarse (N, 3, h, w) RGB image; None when the model has none
    preview: nn.Module | None = None
    # Latents are (z - shift_factor) * scaling_factor (the 16-channel VAEs of SD3 and Flux; 0 for SD 1.x).
    shift_factor: float = 0.0
    # prompts -> the context the denoiser reads, when it is more than one encoder's states (SD3: TextConditioning);
    # None: ContextCache(text_encoder(tokenizer(prompts))).
    conditioning: Callable[[list[str]], ContextCache] | None = None
    # A flow-matching model (SD3, Flux) samples with flow-match Euler under this config, and only with it.
    flow: FlowMatchConfig | None = None
    flow_spacing: str = "default"  # "linspace" for Flux (services/diffusion/flow_match.py)
    # Image sides must be multiples of this (SD3: the VAE's 8 × the 2×2 patches); None: vae_scale_factor.
    size_multiple: int | None = None
    # A 9-channel inpainting U-Net (latents, mask, masked image's latents): it only edits, with a mask.
    inpainting_unet: bool = False

    def uses_guidance(self, guidance_scale: float) -> bool:
        """Whether a step runs the unconditional half next to the conditional one."""
        if self.guidance == "embedded":
            return False
        if self.guidance == "diffusers":
            return guidance_scale > 1.0
        return guidance_scale != 1.0

    def to(self, device: str | torch.device) -> DiffusionComponents:
        for module in (self.unet, self.text_encoder, self.preview):
            if module is not None:
                module.to(device).eval()
        return self
