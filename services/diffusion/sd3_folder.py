"""An SD3-format diffusers pipeline folder (``StableDiffusion3Pipeline.save_pretrained``; Esser et al. 2024,
"Scaling Rectified Flow Transformers for High-Resolution Image Synthesis") loaded onto our own modules.

``transformer/`` (SD3Transformer2DModel: services/diffusion/mmdit.py), ``vae/`` (the 16-channel AutoencoderKL: its
config here, its weights in the ``vae`` service: shared/blocks/autoencoder_kl_flow.py), ``text_encoder/`` and
``text_encoder_2/`` (CLIP-L and CLIP-G, CLIPTextModelWithProjection: services/diffusion/sd_text.py),
``text_encoder_3/`` (T5EncoderModel: services/diffusion/t5_text.py; optional, as in diffusers: without it the T5
part of the prompt is zeros), the three tokenizers, and ``scheduler/`` (FlowMatchEulerDiscreteScheduler:
services/diffusion/flow_match.py).

The prompt becomes (Esser et al. 2024, §3.2, Fig. 2): both CLIPs' penultimate hidden states side by side (77 tokens,
zero-padded to T5's width) followed by T5's 256 tokens, and the two CLIPs' pooled outputs side by side.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from genserve.services.diffusion.clip_tokenizer import CLIPTokenizer
from genserve.services.diffusion.components import DiffusionComponents
from genserve.services.diffusion.flow_match import CLASS_NAME as SCHEDULER_CLASS
from genserve.services.diffusion.flow_match import FlowMatchConfig
from genserve.services.diffusion.mmdit import CLASS_NAME as TRANSFORMER_CLASS
from genserve.services.diffusion.mmdit import load_mmdit
from genserve.services.diffusion.sd_text import PROJECTION_CLASS, load_clip_with_projection
from genserve.services.diffusion.t5_text import CLASS_NAME as T5_CLASS
from genserve.services.diffusion.t5_text import TOKENIZER_CLASSES as T5_TOKENIZERS
from genserve.services.diffusion.t5_text import T5Tokenizer, load_t5_encoder
from genserve.services.diffusion.text_conditioning import TextConditioning
from genserve.shared.blocks.autoencoder_kl import CLASS_NAME as VAE_CLASS
from genserve.shared.blocks.autoencoder_kl import vae_config_from_diffusers
from genserve.shared.blocks.autoencoder_kl_flow import core_config, read_flow_vae_config, shift_factor

PIPELINE_CLASS = "StableDiffusion3Pipeline"
CLIP_TOKENIZERS = ("CLIPTokenizer", "CLIPTokenizerFast")
COMPONENTS = {
    "transformer": (TRANSFORMER_CLASS,), "vae": (VAE_CLASS,), "text_encoder": (PROJECTION_CLASS,),
    "text_encoder_2": (PROJECTION_CLASS,), "tokenizer": CLIP_TOKENIZERS, "tokenizer_2": CLIP_TOKENIZERS,
    "scheduler": (SCHEDULER_CLASS,),
}
OPTIONAL = {"text_encoder_3": (T5_CLASS,), "tokenizer_3": T5_TOKENIZERS}
T5_MAX_LENGTH = 256  # StableDiffusion3Pipeline's max_sequence_length default
MAX_AREA_FACTOR = 4  # up to 4× the native pixels (1024² native: up to 2048²)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    return json.loads(path.read_text())


def check_components(directory: Path, index: dict, components: dict, optional: dict) -> set[str]:
    """Every required component listed with a class we load and present on disk; the optional ones present."""
    where = str(directory / "model_index.json")
    present = set()
    for name, classes in {**components, **optional}.items():
        entry = index.get(name)
        if not isinstance(entry, list) or len(entry) != 2 or entry[1] is None:
            if name in optional:
                continue
            raise ValueError(f"{where}: component {name!r} is missing")
        if entry[1] not in classes:
            raise ValueError(f"{where}: {name} class {entry[1]!r} is not supported (supported: {', '.join(classes)})")
        if not (directory / name).is_dir():
            raise FileNotFoundError(f"{directory / name}/ not found (listed in model_index.json)")
        present.add(name)
    return present


class SD3TextEncoders(nn.Module):
    """prompts -> TextConditioning: tokens (B, 77 + 256, T5 width) and pooled (B, P_L + P_G)."""

    def __init__(self, directory: Path, t5: bool, joint_dim: int) -> None:
        super().__init__()
        self.clip_l = load_clip_with_projection(directory / "text_encoder")
        self.clip_g = load_clip_with_projection(directory / "text_encoder_2")
        self.tokenizers = (CLIPTokenizer(directory / "tokenizer"), CLIPTokenizer(directory / "tokenizer_2"))
        self.t5 = load_t5_encoder(directory / "text_encoder_3") if t5 else None
        self.t5_tokenizer = T5Tokenizer(directory / "tokenizer_3", T5_MAX_LENGTH) if t5 else None
        self.joint_dim = joint_dim

    @property
    def device(self) -> torch.device:
        return self.clip_l.text_projection.weight.device

    def forward(self, prompts: list[str]) -> TextConditioning:
        device = self.device
        (h_l, p_l), (h_g, p_g) = (enc(tok(prompts).to(device)) for enc, tok in
                                  zip((self.clip_l, self.clip_g), self.tokenizers, strict=True))
        clip = torch.cat([h_l, h_g], dim=-1)  # (B, 77, D_L + D_G)
        if self.t5 is None:
            t5 = torch.zeros(len(prompts), T5_MAX_LENGTH, self.joint_dim, device=device)
        else:
            t5 = self.t5(self.t5_tokenizer(prompts).to(device))  # (B, 256, D_T5)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return TextConditioning(torch.cat([clip, t5], dim=1), torch.cat([p_l, p_g], dim=-1))


def load_sd3_components(directory: str | Path, device: str | torch.device = "cpu") -> DiffusionComponents:
    directory = Path(directory)
    index = _read_json(directory / "model_index.json")
    present = check_components(directory, index, COMPONENTS, OPTIONAL)
    if ("text_encoder_3" in present) != ("tokenizer_3" in present):
        raise ValueError(f"{directory / 'model_index.json'}: text_encoder_3 and tokenizer_3 come together")
    scheduler_path = directory / "scheduler" / "scheduler_config.json"
    flow = FlowMatchConfig.from_diffusers(_read_json(scheduler_path), str(scheduler_path))
    raw_vae, vae_where = read_flow_vae_config(directory / "vae")
    vae_config = vae_config_from_diffusers(core_config(raw_vae), vae_where)
    transformer = load_mmdit(directory / "transformer", device)
    c = transformer.config
    text = SD3TextEncoders(directory, "text_encoder_3" in present, c.joint_attention_dim)
    clip_width = text.clip_l.config.dim + text.clip_g.config.dim
    t5_width = text.t5.config.d_model if text.t5 is not None else c.joint_attention_dim
    problems = [
        (c.in_channels != vae_config.latent_channels,
         f"transformer in_channels ({c.in_channels}) differs from the vae's latent_channels "
         f"({vae_config.latent_channels})"),
        (t5_width != c.joint_attention_dim,
         f"text_encoder_3 d_model ({t5_width}) differs from the transformer's joint_attention_dim "
         f"({c.joint_attention_dim})"),
        (clip_width > c.joint_attention_dim,
         f"the CLIP widths ({clip_width}) exceed the transformer's joint_attention_dim ({c.joint_attention_dim})"),
        (text.clip_l.text_projection.out_features + text.clip_g.text_projection.out_features
         != c.pooled_projection_dim, f"the CLIPs' projection_dim sum differs from the transformer's "
         f"pooled_projection_dim ({c.pooled_projection_dim})"),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(f"{directory}: {message}")
    factor = vae_config.downsample_factor
    side = c.sample_size * factor
    return DiffusionComponents(
        unet=transformer, text_encoder=text.to(device), tokenizer=lambda prompts: prompts, schedule=_no_beta_schedule,
        latent_channels=vae_config.latent_channels, native_size=(side, side), vae_scale_factor=factor,
        scaling_factor=vae_config.scaling_factor, shift_factor=shift_factor(raw_vae),
        max_pixels=MAX_AREA_FACTOR * side * side, default_scheduler="euler", guidance="diffusers",
        conditioning=text, flow=flow, size_multiple=factor * c.patch_size)


def _no_beta_schedule(name: str):
    raise ValueError(f"scheduler: this model samples with flow-match Euler only ('euler'), not {name!r}")
