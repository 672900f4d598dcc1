"""One request's denoising between two steps: its latents, sampler, timesteps, encoded text and guidance settings.

`DiffusionPipeline.prepare` makes one; `DiffusionPipeline.generate` runs it alone and `StepBatcher`
(services/diffusion/step_batcher.py) runs many side by side, one U-Net call per step for all of them. Both ask a
state for its rows of the next U-Net call (`model_input`) and hand it back its own rows of the answer (`advance`),
so a request's arithmetic is the same whatever it shares the call with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from genserve.services.diffusion.edits import Inpainting
from genserve.services.diffusion.guidance import combine
from genserve.services.diffusion.lora_rows import RowGroup
from genserve.services.diffusion.loras import LoraUse
from genserve.services.diffusion.schedulers import Scheduler
from genserve.shared.blocks.cross_attention import ContextCache


@dataclass
class Denoising:
    latents: torch.Tensor  # (N, C, h, w), scaled by the model's scaling factor
    sampler: Scheduler  # this request's own: DPM-Solver++ keeps its history between steps
    timesteps: torch.Tensor  # (steps,) on the device
    tembs: torch.Tensor  # (steps, temb_dim): every timestep's embedding, computed once up front
    context: ContextCache  # (kN, T, D): the prompts, then the unconditional texts, then (Perp-Neg) the negatives
    guidance: str
    guidance_scale: float
    negative_weight: float
    generator: torch.Generator  # the seed's own: sampler noise (DDPM, DDIM η > 0) comes from it
    scaling_factor: float
    index: int = 0  # steps done
    shift_factor: float = 0.0  # latents are (z - shift) * scale (SD3, Flux)
    inpainting: Inpainting | None = None  # the image's latents outside the mask are kept (services/diffusion/edits.py)
    lora: LoraUse | None = None  # the request's LoRA and scale, on all its U-Net rows (services/diffusion/loras.py)

    @property
    def images(self) -> int:
        return self.latents.shape[0]

    @property
    def passes(self) -> int:
        """U-Net rows per image: 1 (no guidance), 2 (cfg) or 3 (Perp-Neg with a negative prompt)."""
        return self.context.context.shape[0] // self.images

    @property
    def rows(self) -> int:
        return self.passes * self.images

    @property
    def steps(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.index >= self.steps

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.latents.shape[1:])

    def model_input(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next step's U-Net rows: inputs (kN, C, h, w), timesteps (kN,) and their embedding (1, temb_dim)."""
        x = self.sampler.scale_model_input(self.latents, self.index)
        if self.inpainting is not None:
            x = self.inpainting.condition(x)  # (N, 2C + 1, h, w) for a 9-channel inpainting U-Net
        rows = self.rows
        return torch.cat([x] * self.passes), self.timesteps[self.index].expand(rows), \
            self.tembs[self.index : self.index + 1]

    def advance(self, out: torch.Tensor) -> None:
        """One sampler step from this request's rows (kN, C, h, w) of the U-Net's answer."""
        guided = combine(out, self.passes, self.guidance_scale, self.guidance, self.negative_weight)
        self.latents = self.sampler.step(guided, self.index, self.latents, generator=self.generator)
        self.index += 1
        if self.inpainting is not None:
            self.latents = self.inpainting.blend(self.sampler, self.latents, self.index, self.steps)

    def unscaled(self) -> torch.Tensor:
        """The latents in the VAE's own space (what ``on_step`` and the decoder see)."""
        return self.latents / self.scaling_factor + self.shift_factor


def unet_row_groups(states: Sequence[Denoising]) -> list[RowGroup]:
    """The LoRA groups of one U-Net call that stacks the rows of ``states`` in order (a state without a LoRA: none)."""
    groups, start = [], 0
    for state in states:
        if state.lora is not None:
            groups.append(state.lora.unet_group(start, start + state.rows))
        start += state.rows
    return groups
