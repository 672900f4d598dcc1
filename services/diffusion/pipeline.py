"""Text → VAE latents: tokenize, encode the prompts, then run a sampler with guidance (services/diffusion/guidance.py).

This is the interface the diffusion service codes against. It returns latents in the VAE's own (un-scaled) space,
ready for ``vae.decode``; the service decodes them through the ``vae`` application. ``preview`` gives a cheap
low-resolution RGB impression of any latents (e.g. the intermediate ones ``on_step`` receives) without the VAE.

The whole loop runs on the pipeline's device: the initial noise (and any sampler noise) is drawn on a CPU generator
and moved, as diffusers' StableDiffusionPipeline draws it with ``generator=torch.Generator("cpu")``, so a seed gives
the same images on every device; after that nothing comes back to the host until the caller reads the latents.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from genserve.services.diffusion.components import DiffusionComponents
from genserve.services.diffusion.denoising import Denoising, unet_row_groups
from genserve.services.diffusion.edits import Inpainting, Posterior, add_noise, latent_mask, start_index
from genserve.services.diffusion.flow_match import FlowMatchEulerScheduler
from genserve.services.diffusion.flux_folder import PIPELINE_CLASS as FLUX_CLASS
from genserve.services.diffusion.flux_folder import load_flux_components
from genserve.services.diffusion.guidance import combine
from genserve.services.diffusion.lora_rows import AdaptedContext
from genserve.services.diffusion.loras import LoraConfig, LoraRegistry, LoraUse
from genserve.services.diffusion.model import LatentDiffusion, load_diffusion
from genserve.services.diffusion.params import (
    DEFAULT_GUIDANCE_SCALE,
    DEFAULT_NEGATIVE_WEIGHT,
    DEFAULT_STEPS,
    GUIDANCE_MODES,
    MAX_BATCH,
    MAX_GUIDANCE_SCALE,
    MAX_LORA_SCALE,
    MAX_NEGATIVE_WEIGHT,
    MAX_PROMPT_CHARS,
    MAX_STEPS,
    SCHEDULERS,
    GenerationCancelled,
    LoraNotFound,
)
from genserve.services.diffusion.schedulers import make_scheduler
from genserve.services.diffusion.sd3_folder import PIPELINE_CLASS as SD3_CLASS
from genserve.services.diffusion.sd3_folder import load_sd3_components
from genserve.services.diffusion.sd_folder import INDEX, is_diffusers_pipeline, load_sd_components
from genserve.services.diffusion.step_cache import FirstBlockCache
from genserve.services.diffusion.text_conditioning import TextConditioning
from genserve.shared.blocks.cross_attention import ContextCache
from genserve.shared.seeds import resolve_seed


class DiffusionPipeline:
    def __init__(self, model: LatentDiffusion | DiffusionComponents, device: str | torch.device = "cpu",
                 loras: LoraConfig | None = None) -> None:
        """``loras``: serve LoRAs (a Stable-Diffusion-format pipeline only; services/diffusion/loras.py)."""
        parts = model.components() if isinstance(model, LatentDiffusion) else model
        self.model = parts.to(device)
        self.device = torch.device(device)
        self.tokenizer = parts.tokenizer
        self.loras = None if loras is None else LoraRegistry(self.model, loras, self.device)

    @classmethod
    def from_dir(cls, path: str | Path | None = None, device: str | torch.device = "cpu",
                 loras: LoraConfig | None = None) -> DiffusionPipeline:
        """Load a checkpoint directory: a diffusers Stable Diffusion, SD3 or Flux folder (it has model_index.json)
        or our own format; None -> services/diffusion/weights/."""
        if path is not None and is_diffusers_pipeline(path):
            loaders = {SD3_CLASS: load_sd3_components, FLUX_CLASS: load_flux_components}
            loader = loaders.get(json.loads((Path(path) / INDEX).read_text()).get("_class_name"), load_sd_components)
            return cls(loader(path, device=device), device=device, loras=loras)
        return cls(load_diffusion(path, device=device), device=device, loras=loras)

    @property
    def caches_steps(self) -> bool:
        """Whether requests may turn on step caching: the denoiser is a diffusion transformer."""
        return self.model.conditioning is not None

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, h, w) of one image's latent at the native size."""
        return self.latent_shape_for(*self.model.native_size)

    def latent_shape_for(self, height: int, width: int) -> tuple[int, int, int]:
        f = self.model.vae_scale_factor
        return (self.model.latent_channels, height // f, width // f)

    def size_error(self, height: int, width: int) -> tuple[str, str] | None:
        """(field, message) when the model does not serve height × width pixels, else None."""
        f, limit = self.model.size_multiple or self.model.vae_scale_factor, self.model.max_pixels
        native_h, native_w = self.model.native_size
        if limit == native_h * native_w:
            if (height, width) != (native_h, native_w):
                field = "width" if width != native_w else "height"
                return field, f"this model generates {native_w}x{native_h} only, got {width}x{height}"
            return None
        for field, value in (("width", width), ("height", height)):
            if value < f or value % f:
                return field, f"must be a positive multiple of {f}, got {value}"
        if height * width > limit:
            return "width", f"width x height must be at most {limit} pixels for this model, got {width}x{height}"
        return None

    def option_error(self, scheduler: str | None) -> tuple[str, str] | None:
        """(field, message) when this model cannot run the request's sampler, else None ("" or None: its own)."""
        if self.model.flow is not None and scheduler not in (None, "", "euler"):
            return "scheduler", f"this model samples with flow-match Euler only ('euler' or empty), got {scheduler!r}"
        return None

    def _validate(self, prompts: list[str], negative_prompts: list[str] | None, steps: int, guidance_scale: float,
                  scheduler: str, eta: float, size: tuple[int, int], guidance: str, negative_weight: float) -> None:
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
        if guidance not in GUIDANCE_MODES:
            raise ValueError(f"guidance must be one of {GUIDANCE_MODES}, got {guidance!r}")
        if not 0.0 <= negative_weight <= MAX_NEGATIVE_WEIGHT:
            raise ValueError(f"negative_weight must be in [0, {MAX_NEGATIVE_WEIGHT}], got {negative_weight}")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"eta must be in [0, 1], got {eta}")
        problem = self.size_error(*size) or self.option_error(scheduler)
        if problem is not None:
            raise ValueError(": ".join(problem))

    def lora_use(self, name: str | None, scale: float = 1.0) -> LoraUse | None:
        """A request's LoRA ``name`` at ``scale`` (None or "": none); LoraNotFound when it is not loaded here."""
        if not name:
            return None
        if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
            raise ValueError(f"lora_scale must be in [-{MAX_LORA_SCALE}, {MAX_LORA_SCALE}], got {scale}")
        if self.loras is None:
            raise LoraNotFound(f"LoRA {name!r} is not loaded (this server loads no LoRAs)")
        return self.loras.use(name, scale)

    def unet_rows(self, states: Sequence[Denoising]) -> AbstractContextManager:
        """Where ONE U-Net call that stacks the rows of ``states`` runs: under each one's LoRA, on its rows."""
        return nullcontext() if self.loras is None else self.loras.unet_rows.rows(unet_row_groups(states))

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """(B,) prompts -> (B, T, text dim) cross-attention context."""
        return self.model.text_encoder(self.tokenizer(prompts).to(self.device))

    def guided_output(self, latents: torch.Tensor, t: torch.Tensor, context: torch.Tensor | ContextCache,
                      guidance_scale: float, temb: torch.Tensor | None = None, guidance: str = "cfg",
                      negative_weight: float = DEFAULT_NEGATIVE_WEIGHT) -> torch.Tensor:
        """One guided prediction for N latents, every pass in ONE U-Net batch.

        ``context`` (kN, T, D) stacks the prompts, then the unconditional input, then (``perp_neg`` with negative
        prompts only) the negatives: k = 2 runs classifier-free guidance with the second block as out_u (the
        negative prompt under ``cfg``, the empty caption under ``perp_neg``), k = 3 runs Perp-Neg with the empty
        caption as out_u (services/diffusion/guidance.py). Without guidance (``model.uses_guidance(w)`` false) only
        the prompts run. A `ContextCache` holds exactly the contexts the U-Net reads: kN of them, or only the N
        prompts. ``temb`` (1, temb_dim) is t's time embedding when the caller computed it beforehand."""
        n = latents.shape[0]
        if not self.model.uses_guidance(guidance_scale):
            return self.model.unet(latents, t.expand(n), context if isinstance(context, ContextCache) else context[:n],
                                   temb=temb)
        passes = (context.context if isinstance(context, ContextCache) else context).shape[0] // n
        if passes == 1:
            raise ValueError(f"context must hold 2N rows, or 3N under perp_neg; got 1N with {guidance!r}")
        out = self.model.unet(torch.cat([latents] * passes), t.expand(passes * n), context, temb=temb)  # (kN, C, h, w)
        return combine(out, passes, guidance_scale, guidance, negative_weight)

    def _guidance_texts(self, n: int, negative_prompts: list[str] | None, guidance: str,
                        guidance_scale: float) -> list[str]:
        """The texts after the N prompts: none without guidance; the negatives (or empty captions) under ``cfg``;
        the empty captions, then the negatives when any is non-empty, under ``perp_neg``."""
        if not self.model.uses_guidance(guidance_scale):
            return []
        negatives = list(negative_prompts) if negative_prompts is not None else [""] * n
        if guidance == "cfg":
            return negatives
        return [""] * n + (negatives if any(negatives) else [])

    @torch.inference_mode()
    def prepare(
        self,
        prompts: list[str],
        negative_prompts: list[str] | None = None,
        *,
        steps: int = DEFAULT_STEPS,
        guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
        seed: int | None = None,
        scheduler: str | None = None,
        eta: float = 0.0,
        height: int | None = None,
        width: int | None = None,
        guidance: str | None = None,
        negative_weight: float | None = None,
        init: Posterior | None = None,
        strength: float = 1.0,
        mask: torch.Tensor | None = None,
        cache_threshold: float | None = None,
        masked: Posterior | None = None,
        lora: str | None = None,
        lora_scale: float = 1.0,
    ) -> Denoising:
        """One request, validated, its text encoded and its noise drawn, before its first step (the arguments are
        ``generate``'s). ``init`` (the VAE's posterior of an image at the request's size) makes it image-to-image
        from ``strength``; ``mask`` (1 or N, 1, H, W) in [0, 1], 1 = repaint, with ``init`` makes it inpainting
        (services/diffusion/edits.py). ``cache_threshold`` turns FirstBlockCache on for a diffusion transformer
        (services/diffusion/step_cache.py); None: off. ``masked``: the posterior of
        the image with the mask's region blacked out (image · (mask < 0.5)), which a 9-channel inpainting U-Net
        reads. ``lora`` names a loaded LoRA (services/diffusion/loras.py), applied at ``lora_scale`` to the U-Net and
        to the encoding of the request's texts, as diffusers' ``cross_attention_kwargs={"scale": lora_scale}``."""
        scheduler = scheduler or self.model.default_scheduler
        guidance = guidance or self.model.default_guidance
        negative_weight = self.model.default_negative_weight if negative_weight is None else negative_weight
        native_h, native_w = self.model.native_size
        size = (native_h if height is None else height, native_w if width is None else width)
        self._validate(prompts, negative_prompts, steps, guidance_scale, scheduler, eta, size, guidance,
                       negative_weight)
        adapter = self.lora_use(lora, lora_scale)
        n = len(prompts)
        texts = list(prompts) + self._guidance_texts(n, negative_prompts, guidance, guidance_scale)
        # Every step reads the same text: each cross-attention projects it to keys and values once, not per step.
        cache = self.encode_context(texts, adapter)  # (kN, T, D), k = 1, 2 or 3
        if self.model.guidance == "embedded":  # Flux: the scale is the transformer's input, per row
            cache.guidance = torch.full((n,), float(guidance_scale), device=self.device)
        if cache_threshold is not None:
            if not isinstance(cache, TextConditioning):
                raise ValueError("cache_threshold: step caching runs on diffusion transformers (SD3, Flux) only")
            cache.step_cache = FirstBlockCache(cache_threshold)
        generator = torch.Generator().manual_seed(resolve_seed(seed))
        sampler = self.make_sampler(scheduler, eta, size)
        timesteps = sampler.set_timesteps(steps)
        shape = (n, *self.latent_shape_for(*size))
        start, inpainting = 0, None
        if self.model.inpainting_unet and (init is None or mask is None or masked is None):
            raise ValueError("mask: this is an inpainting model; it needs init_image and mask")
        if init is None:
            if mask is not None:
                raise ValueError("mask: inpainting needs an init_image")
            # Noise is drawn on the CPU generator so a seed gives the same latents on every device.
            latents = torch.randn(shape, generator=generator).to(self.device) * sampler.init_noise_sigma
        else:
            start = start_index(steps, strength, self.model.flow is not None)
            latents, inpainting = self._edit_start(init, mask, shape, size, sampler, generator, start, strength,
                                                   masked)
        # Like the text, the timesteps are known before the first step: embed them all in one batch.
        tembs = self.model.unet.time_embed(timesteps.to(self.device), latents.dtype)  # (steps, temb_dim)
        return Denoising(latents, sampler, timesteps.to(self.device), tembs, cache, guidance, guidance_scale,
                         negative_weight, generator, self.model.scaling_factor, index=start,
                         shift_factor=self.model.shift_factor, inpainting=inpainting, lora=adapter)

    def _edit_start(self, init: Posterior, mask: torch.Tensor | None, shape: tuple[int, ...], size: tuple[int, int],
                    sampler, generator: torch.Generator, start: int, strength: float, masked: Posterior | None = None
                    ) -> tuple[torch.Tensor, Inpainting | None]:
        """The first latents of an edit: the image's posterior sample, scaled and noised to step ``start``; with a
        mask, also what the blending needs. Draws in diffusers' order (edits.py)."""
        n = shape[0]
        for name, value, channels in (("init_image", init.mean, shape[1]), ("mask", mask, 1)):
            if value is None:
                continue
            hw = shape[2:] if name == "init_image" else size
            if value.dim() != 4 or value.shape[0] not in (1, n) or tuple(value.shape[1:]) != (channels, *hw):
                raise ValueError(f"{name}: expected (1 or {n}, {channels}, {hw[0]}, {hw[1]}), got {tuple(value.shape)}")
        # diffusers' inpainting with a 9-channel U-Net at strength 1 never samples the image itself
        unused = self.model.inpainting_unet and mask is not None and strength == 1.0
        x0 = torch.zeros(shape, device=self.device) if unused else init.sample(generator)  # (1 or N, C, h, w)
        x0 = (torch.cat([x0] * (n // x0.shape[0])) - self.model.shift_factor) * self.model.scaling_factor
        noise = torch.randn(shape, generator=generator).to(self.device)
        if mask is None:
            return add_noise(sampler, x0, noise, start), None
        # diffusers samples the masked image's posterior here (a 4-channel U-Net does not read it)
        masked_latents = (masked or init).sample(generator)
        m = latent_mask(mask.to(self.device, x0.dtype), shape[2:])
        latents = noise * sampler.init_noise_sigma if strength == 1.0 else add_noise(sampler, x0, noise, start)
        if self.model.inpainting_unet:
            masked_latents = torch.cat([masked_latents] * (n // masked_latents.shape[0])) * self.model.scaling_factor
        else:
            masked_latents = None
        return latents, Inpainting(x0, noise, torch.cat([m] * (n // m.shape[0])), masked_latents)

    def encode_context(self, texts: list[str], lora: LoraUse | None = None) -> ContextCache:
        """The denoiser's context for these texts: TextConditioning for a DiT, else the encoder's states, encoded
        under ``lora`` (a pipeline serving LoRAs keeps each request's cross-attention keys and values to its own)."""
        if self.model.conditioning is not None:
            return self.model.conditioning(texts)
        if self.loras is None:
            return ContextCache(self.encode_prompts(texts))
        with self.loras.text_rows.rows([] if lora is None else [lora.text_group(len(texts))]):
            states = self.encode_prompts(texts)  # (kN, T, D)
        return AdaptedContext(states, self.loras.unet_rows, [] if lora is None else [lora.unet_group(0, len(texts))])

    def make_sampler(self, scheduler: str, eta: float, size: tuple[int, int]):
        """A fresh sampler: flow-match Euler for a flow model (its dynamic shift reads the image's token count),
        else the named one under the model's noise schedule."""
        if self.model.flow is not None:
            _, h, w = self.latent_shape_for(*size)
            patch = (self.model.size_multiple or self.model.vae_scale_factor) // self.model.vae_scale_factor
            return FlowMatchEulerScheduler(self.model.flow, image_seq_len=(h // patch) * (w // patch),
                                           spacing=self.model.flow_spacing)
        return make_scheduler(scheduler, self.model.schedule(scheduler), eta=eta)

    @torch.inference_mode()
    def step(self, state: Denoising) -> None:
        """One step of one request alone: its rows in one U-Net call."""
        x, t, temb = state.model_input()
        with self.unet_rows([state]):
            out = self.model.unet(x, t, state.context, temb=temb)
        state.advance(out)

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[str],
        negative_prompts: list[str] | None = None,
        *,
        on_step: Callable[[int, int, torch.Tensor], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
        **settings: Any,
    ) -> torch.Tensor:
        """Latents (N, C, h, w) in the VAE's un-scaled space for N prompts, on the pipeline's device.

        ``settings`` are ``prepare``'s: ``steps``, ``guidance_scale``, ``seed``, ``scheduler``, ``eta``, ``height``,
        ``width``, ``guidance``, ``negative_weight``. ``guidance`` None is the model's default
        (``model.default_guidance``), ``negative_weight`` None too. Under ``cfg`` the negative prompt replaces the
        empty caption as the unconditional input; under ``perp_neg`` a non-empty negative adds a third pass,
        weighted by ``negative_weight``, and the empty caption stays the unconditional input. ``seed`` fixes the
        initial noise and any sampler noise (same seed, same prompts, same settings: same latents). ``scheduler``
        None is the model's default; ``height``/``width`` None the native size. ``on_step(step, total, latents)``
        runs after every step with ``step`` counting from 1; ``should_cancel()`` is checked before every step and
        raises ``GenerationCancelled``.
        """
        state = self.prepare(prompts, negative_prompts, **settings)
        while not state.done:
            if should_cancel is not None and should_cancel():
                raise GenerationCancelled(f"cancelled before step {state.index + 1} of {state.steps}")
            self.step(state)
            if on_step is not None:
                on_step(state.index, state.steps, state.unscaled())
        return state.unscaled()

    @torch.inference_mode()
    def preview(self, latents: torch.Tensor) -> torch.Tensor:
        """Un-scaled latents (N, C, h, w) -> a coarse (N, 3, h, w) RGB image in [-1, 1] by the model's 1×1 map."""
        if self.model.preview is None:
            raise ValueError("preview_every: this model has no preview map")
        return self.model.preview(latents.to(self.device)).clamp(-1.0, 1.0)
