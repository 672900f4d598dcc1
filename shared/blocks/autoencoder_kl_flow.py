"""The 16-channel AutoencoderKL of SD3 and Flux (Esser et al. 2024, §5.2.1: more latent channels for better
reconstructions), loaded onto our VAE (shared/blocks/autoencoder.py).

Two things differ from the SD 1.x VAE that shared/blocks/autoencoder_kl.py loads: the 1×1 ``quant_conv`` /
``post_quant_conv`` are absent (``use_quant_conv``/``use_post_quant_conv`` false), which our VAE runs as identity
1×1 convolutions (weights I, bias 0: the same numbers), and latents are normalised by a shift as well as a scale,
z_diffusion = (z − shift_factor) · scaling_factor, which the diffusion pipeline undoes before decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from genserve.shared.blocks.autoencoder import VAE
from genserve.shared.blocks.autoencoder_kl import _our_name, vae_config_from_diffusers
from genserve.shared.checkpoint import load_state_strict, read_safetensors_dir

_QUANT = {"use_quant_conv": "quant_conv", "use_post_quant_conv": "post_quant_conv"}


def shift_factor(raw: dict) -> float:
    return float(raw.get("shift_factor") or 0.0)


def read_flow_vae_config(directory: Path) -> tuple[dict, str]:
    where = str(directory / "config.json")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{where} not found")
    return json.loads((directory / "config.json").read_text()), where


def core_config(raw: dict):
    """The config without what this module handles itself (the quant convs' absence and the shift)."""
    return {k: v for k, v in raw.items() if k not in (*_QUANT, "shift_factor")}


def load_flow_autoencoder_kl(directory: str | Path, device: str | torch.device = "cpu") -> tuple[VAE, float]:
    """(our VAE with the folder's weights, its shift_factor); a missing quant conv becomes the identity."""
    directory = Path(directory)
    raw, where = read_flow_vae_config(directory)
    vae = VAE(vae_config_from_diffusers(core_config(raw), where))
    state = read_safetensors_dir(directory, ("diffusion_pytorch_model", "model"))
    state = {_our_name(k): v.float() if v.is_floating_point() else v for k, v in state.items()}
    for key, module in _QUANT.items():
        if not raw.get(key, True):
            channels = getattr(vae, module).weight.shape[0]
            state[f"{module}.weight"] = torch.eye(channels)[:, :, None, None]
            state[f"{module}.bias"] = torch.zeros(channels)
    load_state_strict(vae, state, str(directory))
    return vae.to(device).eval(), shift_factor(raw)
