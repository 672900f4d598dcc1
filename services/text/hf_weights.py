"""Hugging Face tensor names -> the model's (model.py), for the architectures whose checkpoints are laid out otherwise.

Most families load 1:1. The rest differ only in how they store the same matrices:
- Mixtral: ``block_sparse_moe`` with experts ``w1`` (gate), ``w3`` (up), ``w2`` (down);
- Phi-3: fused ``qkv_proj`` (q, k, v stacked by rows) and ``gate_up_proj`` (gate rows, then up rows);
- gpt-oss: ``router``, and every layer's experts as three stacked tensors: ``gate_up_proj`` (E, dim, 2 hidden) with
  gate and up interleaved by column, ``down_proj`` (E, hidden, dim), and their biases;
- DeepSeek-V3: one ``shared_experts`` FFN (ours is the first of a list), and multi-token-prediction layers past
  ``num_hidden_layers`` that plain decoding does not run.
Split tensors are slices of the loaded ones; gpt-oss's experts are transposed into contiguous copies, once.
"""

from __future__ import annotations

import re

import torch

from genserve.services.text.config import LlamaConfig

_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Phi-3's fused modules -> the projections they hold, in the order of their rows.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def to_model_names(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's names (module docstring); others pass through unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= cfg.n_layers:
            continue  # DeepSeek-V3's multi-token-prediction layers
        if cfg.architecture == "MixtralForCausalLM":
            name = name.replace(".block_sparse_moe.", ".mlp.")
            name = re.sub(r"\.experts\.(\d+)\.(w[123])\.",
                          lambda m: f".experts.{m.group(1)}.{_MIXTRAL_EXPERT[m.group(2)]}.", name)
        elif cfg.architecture == "Phi3ForCausalLM" and name.removesuffix(".weight").rsplit(".", 1)[-1] in \
                FUSED_PROJECTIONS:
            out.update(_split_phi3(name, t, cfg))
            continue
        elif cfg.architecture == "GptOssForCausalLM":
            name = name.replace(".mlp.router.", ".mlp.gate.")
            if ".mlp.experts." in name:
                out.update(_split_gpt_oss(name, t))
                continue
        elif cfg.architecture == "DeepseekV3ForCausalLM":
            name = name.replace(".mlp.shared_experts.", ".mlp.shared_experts.0.")
        out[name] = t
    return out


def fused_rows(fused: str, cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(first row, rows) of each projection in Phi-3's fused ``qkv_proj`` or ``gate_up_proj``, by the config."""
    if fused == "qkv_proj":
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        return {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
    return {"gate_proj": (0, cfg.ffn_hidden), "up_proj": (cfg.ffn_hidden, cfg.ffn_hidden)}


def _split_phi3(name: str, t: torch.Tensor, cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    prefix, fused, _ = name.rsplit(".", 2)
    rows = fused_rows(fused, cfg)
    expected = sum(size for _, size in rows.values())
    if t.shape[0] != expected:
        raise ValueError(f"{name}: {t.shape[0]} rows, expected {expected} ({', '.join(rows)} of the config)")
    return {f"{prefix}.{part}.weight": t[start:start + size] for part, (start, size) in rows.items()}


def _split_gpt_oss(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    prefix, kind = name.rsplit(".", 1)  # "model.layers.i.mlp.experts", "gate_up_proj" | ... _bias
    out = {}
    for e in range(t.shape[0]):
        base = f"{prefix}.{e}"
        if kind == "gate_up_proj":  # (dim, 2 hidden), gate and up interleaved by column
            out[f"{base}.gate_proj.weight"] = t[e, :, 0::2].t().contiguous()
            out[f"{base}.up_proj.weight"] = t[e, :, 1::2].t().contiguous()
        elif kind == "gate_up_proj_bias":
            out[f"{base}.gate_proj.bias"] = t[e, 0::2]
            out[f"{base}.up_proj.bias"] = t[e, 1::2]
        elif kind == "down_proj":  # (hidden, dim)
            out[f"{base}.down_proj.weight"] = t[e].t().contiguous()
        elif kind == "down_proj_bias":
            out[f"{base}.down_proj.bias"] = t[e]
        else:
            raise ValueError(f"{name}: not a gpt-oss expert tensor")
    return out
