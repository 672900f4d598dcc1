"""A Flux-format diffusers pipeline folder (``FluxPipeline.save_pretrained``; Black Forest Labs' FLUX.1) loaded onto
our own modules: ``transformer/`` (FluxTransformer2DModel: services/diffusion/flux.py), ``vae/`` (the 16-channel
AutoencoderKL, shared/blocks/autoencoder_kl_flow.py), ``text_encoder/`` (CLIPTextModel: only its pooled output is
read), ``text_encoder_2/`` (T5EncoderModel: the per-token states, 512 tokens), the two tokenizers and ``scheduler/``
(FlowMatchEulerDiscreteScheduler, dynamic shifting in FLUX.1-dev; σ spaced as FluxPipeline spaces them).

``guidance_scale`` means what FluxPipeline means by it: the distilled guidance fed to the transformer (one pass per
step), not classifier-free guidance; a negative prompt is not used.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from genserve.services.diffusion.clip_tokenizer import CLIPTokenizer
from genserve.services.diffusion.components import DiffusionComponents
from genserve.services.diffusion.flow_match import CLASS_NAME as SCHEDULER_CLASS
from genserve.services.diffusion.flow_match import FlowMatchConfig
from genserve.services.diffusion.flux import CLASS_NAME as TRANSFORMER_CLASS
from genserve.services.diffusion.flux import load_flux
from genserve.services.diffusion.sd3_folder import CLIP_TOKENIZERS, check_components
from genserve.services.diffusion.sd_text import CLASS_NAME as CLIP_CLASS
from genserve.services.diffusion.sd_text import load_clip_with_projection
from genserve.services.diffusion.t5_text import CLASS_NAME as T5_CLASS
from genserve.services.diffusion.t5_text import TOKENIZER_CLASSES as T5_TOKENIZERS
from genserve.services.diffusion.t5_text import T5Tokenizer, load_t5_encoder
from genserve.services.diffusion.text_conditioning import TextConditioning
from genserve.shared.blocks.autoencoder_kl import CLASS_NAME as VAE_CLASS
from genserve.shared.blocks.autoencoder_kl import vae_config_from_diffusers
from genserve.shared.blocks.autoencoder_kl_flow import core_config, read_flow_vae_config, shift_factor

PIPELINE_CLASS = "FluxPipeline"
COMPONENTS = {
    "transformer": (TRANSFORMER_CLASS,), "vae": (VAE_CLASS,), "text_encoder": (CLIP_CLASS,),
    "text_encoder_2": (T5_CLASS,), "tokenizer": CLIP_TOKENIZERS, "tokenizer_2": T5_TOKENIZERS,
    "scheduler": (SCHEDULER_CLASS,),
}
T5_MAX_LENGTH = 512  # FluxPipeline's max_sequence_length default
MAX_AREA_FACTOR = 4


class FluxTextEncoders(nn.Module):
    """prompts -> TextConditioning: T5 tokens (B, 512, D_T5) and CLIP's pooled state (B, D_CLIP)."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.clip = load_clip_with_projection(directory / "text_encoder", class_name=CLIP_CLASS)
        self.clip_tokenizer = CLIPTokenizer(directory / "tokenizer")
        self.t5 = load_t5_encoder(directory / "text_encoder_2")
        self.t5_tokenizer = T5Tokenizer(directory / "tokenizer_2", T5_MAX_LENGTH)

    def forward(self, prompts: list[str]) -> TextConditioning:
        device = self.t5.shared.weight.device
        _, pooled = self.clip(self.clip_tokenizer(prompts).to(device))
        return TextConditioning(self.t5(self.t5_tokenizer(prompts).to(device)), pooled)


def load_flux_components(directory: str | Path, device: str | torch.device = "cpu") -> DiffusionComponents:
    directory = Path(directory)
    index_path = directory / "model_index.json"
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path} not found")
    check_components(directory, json.loads(index_path.read_text()), COMPONENTS, {})
    scheduler_path = directory / "scheduler" / "scheduler_config.json"
    if not scheduler_path.is_file():
        raise FileNotFoundError(f"{scheduler_path} not found")
    raw_scheduler = json.loads(scheduler_path.read_text())
    flow = FlowMatchConfig.from_diffusers(raw_scheduler, str(scheduler_path))
    if raw_scheduler.get("use_flow_sigmas"):
        raise ValueError(f"{scheduler_path}: use_flow_sigmas is not supported")
    raw_vae, vae_where = read_flow_vae_config(directory / "vae")
    vae_config = vae_config_from_diffusers(core_config(raw_vae), vae_where)
    transformer = load_flux(directory / "transformer", device)
    c = transformer.config
    text = FluxTextEncoders(directory)
    problems = [
        (c.in_channels != 4 * vae_config.latent_channels,
         f"transformer in_channels ({c.in_channels}) is not 4 x the vae's latent_channels "
         f"({vae_config.latent_channels})"),
        (text.t5.config.d_model != c.joint_attention_dim,
         f"text_encoder_2 d_model ({text.t5.config.d_model}) differs from the transformer's joint_attention_dim "
         f"({c.joint_attention_dim})"),
        (text.clip.config.dim != c.pooled_projection_dim,
         f"text_encoder hidden_size ({text.clip.config.dim}) differs from the transformer's pooled_projection_dim "
         f"({c.pooled_projection_dim})"),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(f"{directory}: {message}")
    factor = vae_config.downsample_factor
    side = 128 * factor  # FluxPipeline's default_sample_size: 1024 px
    return DiffusionComponents(
        unet=transformer, text_encoder=text.to(device), tokenizer=lambda prompts: prompts, schedule=_no_beta_schedule,
        latent_channels=vae_config.latent_channels, native_size=(side, side), vae_scale_factor=factor,
        scaling_factor=vae_config.scaling_factor, shift_factor=shift_factor(raw_vae),
        max_pixels=MAX_AREA_FACTOR * side * side, default_scheduler="euler",
        guidance="embedded" if c.guidance_embeds else "diffusers", conditioning=text, flow=flow,
        flow_spacing="linspace", size_multiple=2 * factor)


def _no_beta_schedule(name: str):
    raise ValueError(f"scheduler: this model samples with flow-match Euler only ('euler'), not {name!r}")
