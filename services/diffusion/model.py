"""The latent text-to-image model as one checkpoint: U-Net, text encoder, tokenizer vocabulary, noise schedule,
the VAE latent scale factor and a 1×1 latent→RGB preview map, saved as config.json + model.safetensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from genserve.services.common.weights import committed_weights
from genserve.services.diffusion.components import DiffusionComponents
from genserve.services.diffusion.schedulers.schedule import NoiseScheduleConfig
from genserve.services.diffusion.text_encoder import TextEncoder, TextEncoderConfig
from genserve.services.diffusion.tokenizer import WordTokenizer, caption_vocabulary
from genserve.shared.blocks.unet import UNet, UNetConfig
from genserve.shared.checkpoint import load_weights, read_extra, save_checkpoint

DEFAULT_WEIGHTS = committed_weights("diffusion")
# The demo VAE (services/vae) maps 32×32 images to 8×8 latents: 4 pixels per latent cell on each side.
DEMO_VAE_SCALE_FACTOR = 4
# Perp-Neg keeps the prompt's colour, shape and position when a negative prompt is given, where CFG's (prompt −
# negative) extrapolates away from them (docs/models.md, "Negative prompts").
DEMO_DEFAULT_GUIDANCE = "perp_neg"
DEMO_NEGATIVE_WEIGHT = 0.3


@dataclass(frozen=True)
class DiffusionConfig:
    unet: UNetConfig
    text: TextEncoderConfig
    schedule: NoiseScheduleConfig
    vocabulary: tuple[str, ...]
    latent_shape: tuple[int, int, int] = (4, 8, 8)
    # Latents are multiplied by this before diffusion (unit variance, Rombach et al. 2022 §4.3.2) and divided after.
    scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.text.vocab_size != len(self.vocabulary):
            raise ValueError(f"text.vocab_size ({self.text.vocab_size}) must equal len(vocabulary) "
                             f"({len(self.vocabulary)})")
        if self.unet.cross_attention_dim != self.text.dim:
            raise ValueError(f"unet.cross_attention_dim ({self.unet.cross_attention_dim}) must equal text.dim "
                             f"({self.text.dim})")
        if self.unet.in_channels != self.latent_shape[0] or self.unet.out_channels != self.latent_shape[0]:
            raise ValueError("unet.in_channels and out_channels must equal latent_shape[0]")
        if self.latent_shape[1] % self.unet.downsample_factor or self.latent_shape[2] % self.unet.downsample_factor:
            raise ValueError(f"latent_shape {self.latent_shape} must be divisible by the U-Net's "
                             f"{self.unet.downsample_factor}")
        if self.scaling_factor <= 0:
            raise ValueError(f"scaling_factor must be > 0, got {self.scaling_factor}")

    @classmethod
    def from_dict(cls, raw: dict) -> DiffusionConfig:
        """Inverse of ``dataclasses.asdict`` (JSON lists become tuples); unknown keys (training metadata) ignored."""
        def build(kind: type, values: dict):
            names = {f.name for f in dataclasses.fields(kind)}
            return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in names})

        return cls(unet=build(UNetConfig, raw["unet"]), text=build(TextEncoderConfig, raw["text"]),
                   schedule=build(NoiseScheduleConfig, raw["schedule"]), vocabulary=tuple(raw["vocabulary"]),
                   latent_shape=tuple(raw["latent_shape"]), scaling_factor=float(raw["scaling_factor"]))


def default_config(scaling_factor: float = 1.0, channels: tuple[int, ...] = (64, 128), text_dim: int = 64,
                   layers_per_block: int = 1) -> DiffusionConfig:
    """The demo model: 8×8 latents, attention at both levels, cosine schedule with v-prediction."""
    vocabulary = caption_vocabulary()
    return DiffusionConfig(
        unet=UNetConfig(in_channels=4, out_channels=4, block_out_channels=channels, layers_per_block=layers_per_block,
                        attention_levels=tuple(range(len(channels))), cross_attention_dim=text_dim, head_dim=32,
                        norm_groups=32),
        text=TextEncoderConfig(vocab_size=len(vocabulary), max_length=12, dim=text_dim, n_layers=2, n_heads=4),
        # v-prediction keeps x̂_0 = √ᾱ x − √(1−ᾱ) v well conditioned at t = T − 1, where cosine's √ᾱ ≈ 5e-5.
        schedule=NoiseScheduleConfig(beta_schedule="squaredcos_cap_v2", prediction_type="v_prediction",
                                     timestep_spacing="trailing"),
        vocabulary=vocabulary,
        scaling_factor=scaling_factor,
    )


class LatentDiffusion(nn.Module):
    """Holds the trained parts; ``preview`` maps un-scaled latents to a coarse RGB image without the VAE."""

    def __init__(self, config: DiffusionConfig) -> None:
        super().__init__()
        self.config = config
        self.unet = UNet(config.unet)
        self.text_encoder = TextEncoder(config.text)
        self.preview = nn.Conv2d(config.latent_shape[0], 3, 1)

    def tokenizer(self) -> WordTokenizer:
        return WordTokenizer(self.config.vocabulary, self.config.text.max_length)

    def components(self) -> DiffusionComponents:
        """The parts the pipeline runs; one schedule for every sampler, and only the native size."""
        c, h, w = self.config.latent_shape
        f = DEMO_VAE_SCALE_FACTOR
        return DiffusionComponents(
            unet=self.unet, text_encoder=self.text_encoder, tokenizer=self.tokenizer(),
            schedule=lambda name: self.config.schedule, latent_channels=c, native_size=(h * f, w * f),
            vae_scale_factor=f, scaling_factor=self.config.scaling_factor, max_pixels=h * f * w * f,
            default_guidance=DEMO_DEFAULT_GUIDANCE,
            default_negative_weight=DEMO_NEGATIVE_WEIGHT, preview=self.preview)


def save_diffusion(directory: str | Path, model: LatentDiffusion, extra: dict | None = None) -> Path:
    return save_checkpoint(directory, model, model.config, extra)


def load_diffusion(directory: str | Path | None = None, device: str | torch.device = "cpu") -> LatentDiffusion:
    """Build from config.json and load model.safetensors strictly; None -> services/diffusion/weights/."""
    directory = Path(directory) if directory is not None else DEFAULT_WEIGHTS
    model = LatentDiffusion(DiffusionConfig.from_dict(read_extra(directory)))
    load_weights(directory, model, device=device)
    return model.to(device).eval()
