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
        elif cfg.architecture == "Phi3ForCausalLM" and name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
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


def _split_phi3(name: str, t: torch.Tensor, cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    prefix = name.rsplit(".", 2)[0]
    if name.endswith("qkv_proj.weight"):
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        if t.shape[0] != q + 2 * kv:
            raise ValueError(f"{name}: {t.shape[0]} rows, expected {q + 2 * kv} (q, k, v heads of the config)")
        wq, wk, wv = t.split((q, kv, kv))
        return {f"{prefix}.q_proj.weight": wq, f"{prefix}.k_proj.weight": wk, f"{prefix}.v_proj.weight": wv}
    gate, up = t.chunk(2)
    return {f"{prefix}.gate_proj.weight": gate, f"{prefix}.up_proj.weight": up}


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
