"""A Stable-Diffusion-format diffusers pipeline folder loaded onto our own modules.

The layout (``StableDiffusionPipeline.save_pretrained``; SD 1.x, 2.x and the fine-tunes that share it):
``model_index.json``; ``unet/`` (UNet2DConditionModel), ``vae/`` (AutoencoderKL; only its config is read here, the
``vae`` service loads its weights), ``text_encoder/`` (CLIPTextModel), ``tokenizer/`` (CLIP BPE) and ``scheduler/``
(``scheduler_config.json``). A missing file, an unknown class in ``model_index.json`` or a config we do not support
fails here, at start-up, with the file and key named. The safety checker and feature extractor, when listed, are
not run.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from genserve.services.diffusion.clip_tokenizer import CLIPTokenizer
from genserve.services.diffusion.components import DiffusionComponents
from genserve.services.diffusion.sd_schedule import SCHEDULER_CLASSES, check_scheduler_config, schedule_for
from genserve.services.diffusion.sd_text import CLASS_NAME as TEXT_CLASS
from genserve.services.diffusion.sd_text import load_clip_text
from genserve.services.diffusion.sd_unet import CLASS_NAME as UNET_CLASS
from genserve.services.diffusion.sd_unet import load_unet
from genserve.shared.blocks.autoencoder_kl import CLASS_NAME as VAE_CLASS
from genserve.shared.blocks.autoencoder_kl import vae_config_from_diffusers

INDEX = "model_index.json"
# An inpainting folder's U-Net may take 9 channels: the latents, the mask and the masked image's latents.
PIPELINE_CLASSES = ("StableDiffusionPipeline", "StableDiffusionInpaintPipeline")
# component -> the classes we can load for it
COMPONENTS = {
    "unet": (UNET_CLASS,),
    "vae": (VAE_CLASS,),
    "text_encoder": (TEXT_CLASS,),
    "tokenizer": ("CLIPTokenizer", "CLIPTokenizerFast"),
    "scheduler": tuple(SCHEDULER_CLASSES),
}
# An image may hold at most this many times the native size's pixels (SD 1.x at 512×512: up to 1024×1024).
MAX_AREA_FACTOR = 4


def is_diffusers_pipeline(directory: str | Path) -> bool:
    return (Path(directory) / INDEX).is_file()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc


def check_index(directory: Path) -> dict:
    """model_index.json, with every class we need known; ValueError/FileNotFoundError naming what is wrong."""
    index = _read_json(directory / INDEX)
    where = str(directory / INDEX)
    if index.get("_class_name") not in PIPELINE_CLASSES:
        raise ValueError(f"{where}: _class_name {index.get('_class_name')!r} is not supported "
                         f"(supported: {', '.join(PIPELINE_CLASSES)})")
    for name, classes in COMPONENTS.items():
        entry = index.get(name)
        if not isinstance(entry, list) or len(entry) != 2 or entry[1] is None:
            raise ValueError(f"{where}: component {name!r} is missing")
        if entry[1] not in classes:
            raise ValueError(f"{where}: {name} class {entry[1]!r} is not supported (supported: {', '.join(classes)})")
        if not (directory / name).is_dir():
            raise FileNotFoundError(f"{directory / name}/ not found (listed in {INDEX})")
    return index


def load_sd_components(directory: str | Path, device: str | torch.device = "cpu") -> DiffusionComponents:
    """Everything the pipeline needs from a Stable Diffusion folder, on ``device``."""
    directory = Path(directory)
    index = check_index(directory)
    scheduler_path = directory / "scheduler" / "scheduler_config.json"
    scheduler_raw = _read_json(scheduler_path)
    check_scheduler_config(scheduler_raw, str(scheduler_path))
    vae_path = directory / "vae" / "config.json"
    vae_config = vae_config_from_diffusers(_read_json(vae_path), str(vae_path))
    unet, unet_raw = load_unet(directory / "unet", device)
    text_encoder = load_clip_text(directory / "text_encoder", device)
    tokenizer = CLIPTokenizer(directory / "tokenizer")
    if unet.config.cross_attention_dim != text_encoder.config.dim:
        raise ValueError(f"{directory}: unet cross_attention_dim ({unet.config.cross_attention_dim}) differs from "
                         f"the text encoder's hidden_size ({text_encoder.config.dim})")
    if tokenizer.vocab_size > text_encoder.config.vocab_size:
        raise ValueError(f"{directory}: the tokenizer has {tokenizer.vocab_size} tokens, more than the text encoder's "
                         f"vocab_size ({text_encoder.config.vocab_size})")
    if tokenizer.max_length > text_encoder.config.max_positions:
        raise ValueError(f"{directory}: tokenizer model_max_length ({tokenizer.max_length}) exceeds the text "
                         f"encoder's max_position_embeddings ({text_encoder.config.max_positions})")
    inpainting = unet.config.in_channels == 2 * vae_config.latent_channels + 1
    if unet.config.in_channels != vae_config.latent_channels and not inpainting:
        raise ValueError(f"{directory}: unet in_channels ({unet.config.in_channels}) differs from the vae's "
                         f"latent_channels ({vae_config.latent_channels})")
    factor = vae_config.downsample_factor
    sample = unet_raw.get("sample_size", 64)
    h, w = (sample, sample) if isinstance(sample, int) else tuple(sample)
    default_sampler = SCHEDULER_CLASSES[index["scheduler"][1]]
    schedules = {name: None for name in ("ddpm", "ddim", "dpmpp_2m", "euler")}

    def schedule(name: str):
        if schedules[name] is None:
            schedules[name] = schedule_for(scheduler_raw, name, str(scheduler_path))
        return schedules[name]

    schedule(default_sampler)  # a config the default sampler cannot run fails at start-up
    return DiffusionComponents(
        unet=unet, text_encoder=text_encoder, tokenizer=tokenizer, schedule=schedule,
        latent_channels=vae_config.latent_channels, native_size=(h * factor, w * factor), vae_scale_factor=factor,
        scaling_factor=vae_config.scaling_factor, max_pixels=MAX_AREA_FACTOR * h * factor * w * factor,
        default_scheduler=default_sampler, guidance="diffusers", inpainting_unet=inpainting)
