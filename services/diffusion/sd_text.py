"""transformers' CLIPTextModel (Stable Diffusion's prompt encoder) from its folder, ``config.json`` +
``model.safetensors``, mapped onto shared/blocks/clip_text.py: HF's ``[text_model.]encoder.layers.{i}`` with
``layer_norm1``/``self_attn.out_proj``/``layer_norm2`` become our pre-norm block's ``input_layernorm``/
``self_attn.o_proj``/``post_attention_layernorm``.

``CLIPTextModelWithProjection`` (SD3's CLIP-L and CLIP-G, Flux's CLIP-L) loads into `CLIPWithProjection`: the same
transformer plus ``text_projection``, giving what SD3 reads (Esser et al. 2024, §3.2 and Fig. 2): the penultimate
layer's hidden states and the pooled, projected end-of-text state.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from genserve.shared.blocks.clip_text import CLIPTextConfig, CLIPTextTransformer
from genserve.shared.checkpoint import load_state_strict, read_safetensors_dir, supported

CLASS_NAME = "CLIPTextModel"
PROJECTION_CLASS = "CLIPTextModelWithProjection"
# Released checkpoints prefix every name with "text_model."; transformers 5 saves write them without it.
_RENAMES = [
    (re.compile(r"^text_model\."), ""),
    (re.compile(r"^embeddings\."), ""),
    (re.compile(r"^encoder\.layers\."), "layers."),
    (re.compile(r"\.layer_norm1\."), ".input_layernorm."),
    (re.compile(r"\.layer_norm2\."), ".post_attention_layernorm."),
    (re.compile(r"\.self_attn\.out_proj\."), ".self_attn.o_proj."),
]


def clip_config_from_transformers(raw: dict, where: str, class_name: str = CLASS_NAME) -> CLIPTextConfig:
    supported(raw, "architectures", [class_name], ([class_name],), where)
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


class CLIPWithProjection(nn.Module):
    """ids (B, T) -> (hidden states after layer ``n_layers − 1 − skip`` (B, T, dim), no final norm; pooled
    (B, projection_dim)): the final-normed state at the first end-of-text token, times ``text_projection``."""

    def __init__(self, config: CLIPTextConfig, projection_dim: int | None, eos_token_id: int) -> None:
        super().__init__()
        self.model = CLIPTextTransformer(config)
        # None: a plain CLIPTextModel, whose pooled output is the unprojected state (Flux reads that)
        self.text_projection = nn.Identity() if projection_dim is None else \
            nn.Linear(config.dim, projection_dim, bias=False)
        self.eos_token_id = eos_token_id

    @property
    def config(self) -> CLIPTextConfig:
        return self.model.config

    def forward(self, ids: torch.Tensor, skip: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = m.token_embedding(ids) + m.position_embedding(positions)[None]  # (B, T, dim)
        penultimate = None
        for i, layer in enumerate(m.layers):
            x = layer(x, causal=True)
            if i == len(m.layers) - 2 - skip:
                penultimate = x
        # transformers' rule: eos_token_id 2 marks configs from before the fix, where the highest id is the end
        eos = ids.argmax(-1) if self.eos_token_id == 2 else (ids == self.eos_token_id).int().argmax(-1)
        pooled = m.final_layer_norm(x)[torch.arange(ids.shape[0], device=ids.device), eos]
        return penultimate, self.text_projection(pooled)


def load_clip_with_projection(directory: str | Path, device: str | torch.device = "cpu",
                              class_name: str = PROJECTION_CLASS) -> CLIPWithProjection:
    """A CLIPTextModelWithProjection folder (or, with ``class_name`` CLIPTextModel, a plain one: pooled unprojected)."""
    directory = Path(directory)
    where = str(directory / "config.json")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{where} not found")
    raw = json.loads((directory / "config.json").read_text())
    config = clip_config_from_transformers(raw, where, class_name)
    if config.n_layers < 2:
        raise ValueError(f"{where}: num_hidden_layers must be >= 2 (the penultimate layer is read)")
    projection = int(raw.get("projection_dim", config.dim)) if class_name == PROJECTION_CLASS else None
    model = CLIPWithProjection(config, projection, int(raw.get("eos_token_id", 2)))
    state = read_safetensors_dir(directory, ("model",))
    state = {("text_projection.weight" if k == "text_projection.weight" else "model." + _our_name(k)): v.float()
             for k, v in state.items() if not k.endswith("position_ids")}
    load_state_strict(model, state, str(directory))
    return model.to(device).eval()
