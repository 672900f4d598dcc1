"""diffusers' AutoencoderKL (the Stable Diffusion VAE) from its folder, ``config.json`` +
``diffusion_pytorch_model.safetensors``, mapped onto our VAE
(shared/blocks/autoencoder.py), whose module tree follows it.

The only renames: the mid-block attention's projections live in ``attentions.0.attn`` here (our
SpatialSelfAttention composes a CrossAttention), and pre-0.14 diffusers saves name them query/key/value/proj_attn.
Anything in the config that our VAE does not implement is refused with the key named.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from genserve.shared.blocks.autoencoder import VAE, VAEConfig
from genserve.shared.checkpoint import load_state_strict, read_safetensors_dir, supported

CLASS_NAME = "AutoencoderKL"
_OLD_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}
_ATTENTION = re.compile(r"(\.mid_block\.attentions\.0\.)(to_q|to_k|to_v|to_out\.0|query|key|value|proj_attn)\.")


def is_autoencoder_kl(directory: str | Path) -> bool:
    path = Path(directory) / "config.json"
    return path.is_file() and json.loads(path.read_text()).get("_class_name") == CLASS_NAME


def vae_config_from_diffusers(raw: dict, where: str) -> VAEConfig:
    """Our VAEConfig for an AutoencoderKL config.json, or a ValueError naming the unsupported key."""
    channels = tuple(raw["block_out_channels"])
    down, up = ["DownEncoderBlock2D"] * len(channels), ["UpDecoderBlock2D"] * len(channels)
    supported(raw, "down_block_types", down, (down,), where)
    supported(raw, "up_block_types", up, (up,), where)
    supported(raw, "act_fn", "silu", ("silu",), where)
    supported(raw, "use_quant_conv", True, (True,), where)
    supported(raw, "use_post_quant_conv", True, (True,), where)
    supported(raw, "shift_factor", 0.0, (0.0,), where)
    supported(raw, "latents_mean", None, (None,), where)
    in_channels = int(raw.get("in_channels", 3))
    supported(raw, "out_channels", in_channels, (in_channels,), where)
    factor = 2 ** (len(channels) - 1)
    sample_size = raw.get("sample_size", 32 * factor)
    sample_size = sample_size[0] if isinstance(sample_size, list) else sample_size
    return VAEConfig(in_channels=in_channels, image_size=int(sample_size), latent_channels=int(raw["latent_channels"]),
                     block_out_channels=channels, layers_per_block=int(raw.get("layers_per_block", 1)),
                     norm_groups=int(raw.get("norm_num_groups", 32)),
                     scaling_factor=float(raw.get("scaling_factor", 0.18215)),
                     mid_attention=bool(raw.get("mid_block_add_attention", True)))


def _our_name(name: str) -> str:
    def rename(match: re.Match) -> str:
        return f"{match.group(1)}attn.{_OLD_ATTENTION.get(match.group(2), match.group(2))}."

    return _ATTENTION.sub(rename, name)


def load_autoencoder_kl(directory: str | Path, device: str | torch.device = "cpu") -> VAE:
    """Build our VAE from an AutoencoderKL folder and load its weights strictly (fp16 weights become fp32)."""
    directory = Path(directory)
    where = str(directory / "config.json")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{where} not found")
    vae = VAE(vae_config_from_diffusers(json.loads((directory / "config.json").read_text()), where))
    state = read_safetensors_dir(directory, ("diffusion_pytorch_model", "model"))
    state = {_our_name(k): v.float() if v.is_floating_point() else v for k, v in state.items()}
    load_state_strict(vae, state, str(directory))
    return vae.to(device).eval()
