"""diffusers' UNet2DConditionModel (the Stable Diffusion denoiser) from its folder, ``config.json`` +
``diffusion_pytorch_model.safetensors``, mapped onto shared/blocks/unet.py, whose module tree follows it name for
name. What the mapping bridges: ``attention_head_dim`` that really counts heads (diffusers' naming trap, when
``num_attention_heads`` is null), GEGLU feedforwards, and 1×1-conv ``proj_in``/``proj_out``
(``use_linear_projection: false``), which are the same map on the channel axis as our linear ones.
Every config key that asks for something else is refused with its name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from genserve.shared.blocks.unet import UNet, UNetConfig
from genserve.shared.checkpoint import load_state_strict, read_safetensors_dir, supported

CLASS_NAME = "UNet2DConditionModel"
CROSS_DOWN, PLAIN_DOWN, CROSS_UP, PLAIN_UP = "CrossAttnDownBlock2D", "DownBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"

# Keys whose only supported value is diffusers' default for Stable Diffusion 1.x/2.x.
_FIXED = {
    "center_input_sample": False, "flip_sin_to_cos": True, "freq_shift": 0, "mid_block_type": "UNetMidBlock2DCrossAttn",
    "only_cross_attention": False, "downsample_padding": 1, "mid_block_scale_factor": 1, "act_fn": "silu",
    "encoder_hid_dim": None, "dual_cross_attention": False, "class_embed_type": None, "addition_embed_type": None,
    "num_class_embeds": None, "resnet_time_scale_shift": "default", "resnet_skip_time_act": False,
    "resnet_out_scale_factor": 1.0, "time_embedding_type": "positional", "time_embedding_dim": None,
    "time_embedding_act_fn": None, "timestep_post_act": None, "time_cond_proj_dim": None, "conv_in_kernel": 3,
    "conv_out_kernel": 3, "attention_type": "default", "cross_attention_norm": None,
    "mid_block_only_cross_attention": None, "reverse_transformer_layers_per_block": None,
}


def _per_level(raw: dict, key: str, n: int, where: str) -> tuple[int, ...]:
    value = raw.get(key)
    values = tuple(value) if isinstance(value, list) else (value,) * n
    if len(values) != n or not all(isinstance(v, int) for v in values):
        raise ValueError(f"{where}: {key}={value!r} must be an int or one int per block")
    return values


def unet_config_from_diffusers(raw: dict, where: str) -> UNetConfig:
    """Our UNetConfig for a UNet2DConditionModel config.json, or a ValueError naming the unsupported key."""
    for key, default in _FIXED.items():
        supported(raw, key, default, (default,), where)
    channels = tuple(raw["block_out_channels"])
    n = len(channels)
    down = tuple(raw["down_block_types"])
    for kind in down:
        supported({"down_block_types": kind}, "down_block_types", kind, (CROSS_DOWN, PLAIN_DOWN), where)
    mirrored = tuple(CROSS_UP if kind == CROSS_DOWN else PLAIN_UP for kind in reversed(down))
    supported({"up_block_types": tuple(raw["up_block_types"])}, "up_block_types", None, (mirrored,), where)
    if len(down) != n:
        raise ValueError(f"{where}: down_block_types has {len(down)} entries for {n} block_out_channels")
    if set(_per_level(raw, "transformer_layers_per_block", n, where) if "transformer_layers_per_block" in raw
           else (1,)) != {1}:
        raise ValueError(f"{where}: transformer_layers_per_block={raw['transformer_layers_per_block']!r} is not "
                         "supported (supported: 1)")
    cross = raw.get("cross_attention_dim")
    if not isinstance(cross, int):
        raise ValueError(f"{where}: cross_attention_dim={cross!r} is not supported (supported: one int)")
    heads_key = "num_attention_heads" if raw.get("num_attention_heads") is not None else "attention_head_dim"
    heads = _per_level(raw, heads_key, n, where)
    eps = float(raw.get("norm_eps", 1e-5))
    return UNetConfig(
        in_channels=int(raw.get("in_channels", 4)), out_channels=int(raw.get("out_channels", 4)),
        block_out_channels=channels, layers_per_block=int(raw.get("layers_per_block", 2)),
        attention_levels=tuple(i for i, kind in enumerate(down) if kind == CROSS_DOWN), cross_attention_dim=cross,
        attention_heads=heads, norm_groups=int(raw.get("norm_num_groups", 32)), resnet_eps=eps, out_norm_eps=eps,
        ff="geglu", head_dim=channels[0] // heads[0])


def _as_linear(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A 1×1 conv ``proj_in``/``proj_out`` weight (C_out, C_in, 1, 1) as the linear (C_out, C_in) it equals."""
    if name.endswith((".proj_in.weight", ".proj_out.weight")) and tensor.dim() == 4:
        return tensor[:, :, 0, 0]
    return tensor


def load_unet(directory: str | Path, device: str | torch.device = "cpu") -> tuple[UNet, dict]:
    """(our UNet with the folder's weights, the raw config) for a UNet2DConditionModel folder."""
    directory = Path(directory)
    where = str(directory / "config.json")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{where} not found")
    raw = json.loads((directory / "config.json").read_text())
    unet = UNet(unet_config_from_diffusers(raw, where))
    state = read_safetensors_dir(directory, ("diffusion_pytorch_model",))
    state = {k: _as_linear(k, v).float() for k, v in state.items()}
    load_state_strict(unet, state, str(directory))
    return unet.to(device).eval(), raw
