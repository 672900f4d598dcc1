"""Text → VAE latents: tokenize, encode the prompts, then run a sampler with classifier-free guidance.

This is the interface the diffusion service codes against. It returns latents in the VAE's own (un-scaled) space,
ready for ``vae.decode``; the service decodes them through the ``vae`` application. ``preview`` gives a cheap
8×8 RGB impression of any latents (e.g. the intermediate ones ``on_step`` receives) without the VAE.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from services.diffusion.model import LatentDiffusion, load_diffusion
from services.diffusion.schedulers import SCHEDULERS, make_scheduler
from shared.blocks.cross_attention import ContextCache

MAX_STEPS = 200
MAX_BATCH = 16
MAX_GUIDANCE_SCALE = 20.0
MAX_PROMPT_CHARS = 200
DEFAULT_STEPS = 20
DEFAULT_GUIDANCE_SCALE = 3.0

__all__ = ["DEFAULT_GUIDANCE_SCALE", "DEFAULT_STEPS", "MAX_BATCH", "MAX_GUIDANCE_SCALE", "MAX_PROMPT_CHARS",
           "MAX_STEPS", "SCHEDULERS", "Cancelled", "DiffusionPipeline"]


class Cancelled(Exception):
    """Raised by ``generate`` when ``should_cancel()`` returned True between two steps."""


class DiffusionPipeline:
    def __init__(self, model: LatentDiffusion, device: str | torch.device = "cpu") -> None:
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.tokenizer = model.tokenizer()
        self.config = model.config

    @classmethod
    def from_dir(cls, path: str | Path | None = None, device: str | torch.device = "cpu") -> DiffusionPipeline:
        """Load a checkpoint directory; None -> services/diffusion/weights/."""
        return cls(load_diffusion(path, device=device), device=device)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, h, w) of one image's latent."""
        return tuple(self.config.latent_shape)

    def _validate(self, prompts: list[str], negative_prompts: list[str] | None, steps: int, guidance_scale: float,
                  scheduler: str, eta: float) -> None:
        if not 1 <= len(prompts) <= MAX_BATCH:
            raise ValueError(f"prompts must hold 1 to {MAX_BATCH} prompts, got {len(prompts)}")
        if negative_prompts is not None and len(negative_prompts) != len(prompts):
            raise ValueError(f"negative_prompts must match prompts in length ({len(prompts)}), "
                             f"got {len(negative_prompts)}")
        for text in prompts + (negative_prompts or []):
            if len(text) > MAX_PROMPT_CHARS:
                raise ValueError(f"prompts must be at most {MAX_PROMPT_CHARS} characters, got {len(text)}")
        if not 1 <= steps <= MAX_STEPS:
            raise ValueError(f"steps must be in [1, {MAX_STEPS}], got {steps}")
        if not 0.0 <= guidance_scale <= MAX_GUIDANCE_SCALE:
            raise ValueError(f"guidance_scale must be in [0, {MAX_GUIDANCE_SCALE}], got {guidance_scale}")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"eta must be in [0, 1], got {eta}")

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """(B,) prompts -> (B, T, text dim) cross-attention context."""
        return self.model.text_encoder(self.tokenizer(prompts).to(self.device))

    def guided_output(self, latents: torch.Tensor, t: torch.Tensor, context: torch.Tensor | ContextCache,
                      guidance_scale: float, temb: torch.Tensor | None = None) -> torch.Tensor:
        """Classifier-free guidance (Ho & Salimans 2022): out_u + w (out_c − out_u), with the conditional and the
        unconditional (negative-prompt) halves of ``context`` (2N, T, D) in ONE U-Net batch. w = 1 skips the
        unconditional half; w = 0 is the unconditional (negative-prompt) model alone. A `ContextCache` holds
        exactly the contexts the U-Net reads: 2N of them, or only the N conditional ones when w = 1. ``temb``
        (1, temb_dim) is t's time embedding when the caller computed it beforehand."""
        n = latents.shape[0]
        if guidance_scale == 1.0:
            return self.model.unet(latents, t.expand(n), context if isinstance(context, ContextCache) else context[:n],
                                   temb=temb)
        out = self.model.unet(torch.cat([latents, latents]), t.expand(2 * n), context, temb=temb)  # (2N, C, h, w)
        cond, uncond = out.chunk(2)
        return uncond + guidance_scale * (cond - uncond)

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[str],
        negative_prompts: list[str] | None = None,
        *,
        steps: int = DEFAULT_STEPS,
        guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
        seed: int | None = None,
        scheduler: str = "ddim",
        eta: float = 0.0,
        on_step: Callable[[int, int, torch.Tensor], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """Latents (N, C, h, w) in the VAE's un-scaled space for N prompts.

        The negative prompt replaces the empty caption as the unconditional input. ``seed`` fixes the initial
        noise and any sampler noise (same seed, same prompts, same settings: same latents). ``on_step(step, total,
        latents)`` runs after every step with ``step`` counting from 1; ``should_cancel()`` is checked before
        every step and raises ``Cancelled``.
        """
        self._validate(prompts, negative_prompts, steps, guidance_scale, scheduler, eta)
        n = len(prompts)
        uncond = negative_prompts if negative_prompts is not None else [""] * n
        context = self.encode_prompts(list(prompts) + list(uncond))  # (2N, T, D)
        # Every step reads the same text: each cross-attention projects it to keys and values once, not per step.
        cache = ContextCache(context[:n] if guidance_scale == 1.0 else context)
        generator = torch.Generator().manual_seed(seed if seed is not None else int(torch.seed() % 2**63))
        sampler = make_scheduler(scheduler, self.config.schedule, eta=eta)
        timesteps = sampler.set_timesteps(steps)
        # Noise is drawn on the CPU generator so a seed gives the same latents on every device.
        latents = torch.randn((n, *self.latent_shape), generator=generator).to(self.device)
        scale = self.config.scaling_factor
        # Like the text, the timesteps are known before the first step: embed them all in one batch.
        tembs = self.model.unet.time_embed(timesteps.to(self.device), latents.dtype)  # (steps, temb_dim)
        for i, t in enumerate(timesteps):
            if should_cancel is not None and should_cancel():
                raise Cancelled(f"cancelled before step {i + 1} of {steps}")
            out = self.guided_output(latents, t.to(self.device), cache, guidance_scale, tembs[i : i + 1])
            latents = sampler.step(out.cpu(), i, latents.cpu(), generator=generator).to(self.device)
            if on_step is not None:
                on_step(i + 1, steps, latents / scale)
        return latents / scale

    @torch.inference_mode()
    def preview(self, latents: torch.Tensor) -> torch.Tensor:
        """Un-scaled latents (N, C, h, w) -> a coarse (N, 3, h, w) RGB image in [-1, 1] by the fitted 1×1 map."""
        return self.model.preview(latents.to(self.device)).clamp(-1.0, 1.0)
