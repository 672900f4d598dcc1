"""transformers' CLIPTextModel (Stable Diffusion's prompt encoder) from its folder, ``config.json`` +
``model.safetensors``, mapped onto shared/blocks/clip_text.py: HF's ``[text_model.]encoder.layers.{i}`` with
``layer_norm1``/``self_attn.out_proj``/``layer_norm2`` become our pre-norm block's ``input_layernorm``/
``self_attn.o_proj``/``post_attention_layernorm``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from genserve.shared.blocks.clip_text import CLIPTextConfig, CLIPTextTransformer
from genserve.shared.checkpoint import load_state_strict, read_safetensors_dir, supported

CLASS_NAME = "CLIPTextModel"
# Released checkpoints prefix every name with "text_model."; transformers 5 saves write them without it.
_RENAMES = [
    (re.compile(r"^text_model\."), ""),
    (re.compile(r"^embeddings\."), ""),
    (re.compile(r"^encoder\.layers\."), "layers."),
    (re.compile(r"\.layer_norm1\."), ".input_layernorm."),
    (re.compile(r"\.layer_norm2\."), ".post_attention_layernorm."),
    (re.compile(r"\.self_attn\.out_proj\."), ".self_attn.o_proj."),
]


def clip_config_from_transformers(raw: dict, where: str) -> CLIPTextConfig:
    supported(raw, "architectures", [CLASS_NAME], ([CLASS_NAME],), where)
    act = supported(raw, "hidden_act", "quick_gelu", ("quick_gelu", "gelu"), where)
    return CLIPTextConfig(vocab_size=int(raw["vocab_size"]), dim=int(raw["hidden_size"]),
                          ffn_hidden_dim=int(raw["intermediate_size"]), n_layers=int(raw["num_hidden_layers"]),
                          n_heads=int(raw["num_attention_heads"]),
                          max_positions=int(raw.get("max_position_embeddings", 77)), act=act,
                          norm_eps=float(raw.get("layer_norm_eps", 1e-5)))


def _our_name(name: str) -> str:
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


def load_clip_text(directory: str | Path, device: str | torch.device = "cpu") -> CLIPTextTransformer:
    directory = Path(directory)
    where = str(directory / "config.json")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{where} not found")
    model = CLIPTextTransformer(clip_config_from_transformers(json.loads((directory / "config.json").read_text()),
                                                              where))
    state = read_safetensors_dir(directory, ("model",))
    # position_ids is a buffer of 0..76 in older saves, not a weight
    state = {_our_name(k): v.float() for k, v in state.items() if not k.endswith("position_ids")}
    load_state_strict(model, state, str(directory))
    return model.to(device).eval()
