"""LoRA adapters in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``; pickled weights are never
read), checked against the base model they are loaded for.

A tensor ``base_model.model.<module>.lora_A.weight`` (r, in) or ``...lora_B.weight`` (out, r) adapts ``<module>``,
one of a decoder layer's q/k/v/o projections (``self_attn.q_proj`` ...) or SwiGLU's gate/up/down (``mlp.gate_proj``
...). Architectures whose checkpoints fuse projections (Phi-3's ``qkv_proj`` and ``gate_up_proj``, split at load by
hf_weights.py) have adapters on the fused module: its A is shared, so the delta of each part is exactly its rows of
B, and the adapter is split the same way. The scale is ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
``use_rslora``; it is folded into B here. Anything else (DoRA, bias training, ``modules_to_save``, per-module rank
or alpha patterns, embedding or LM-head targets, MoE experts, MLA's projections) is refused at load, as is a tensor
of the wrong shape, naming the tensor and the shape expected.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from genserve.services.text.engine.params import InvalidAdapter
from genserve.services.text.hf_weights import FUSED_PROJECTIONS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, by PEFT module name, and the sublayer holding each.
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
# adapter_config.json options that change the math; served only at these values.
_PLAIN = {"use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
          "layer_replication": None, "lora_bias": False}

Module = tuple[int, str]  # (layer index, projection name such as "q_proj")


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A loaded adapter: per adapted projection, A (r, in) and the scaled B (out, r), fp32 on the CPU.
    ``fingerprint`` names the weights and config (the prefix cache keys a sequence's blocks by it)."""

    name: str
    path: Path
    rank: int
    scale: float
    weights: dict[Module, tuple[torch.Tensor, torch.Tensor]]
    fingerprint: bytes

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(sorted({name for _, name in self.weights}))


def load_adapter(name: str, path: Path, projections: dict[Module, tuple[int, int]], max_rank: int) -> LoraAdapter:
    """Read the PEFT adapter in folder ``path`` for a base model whose adaptable projections are ``projections``
    ((layer, name) -> (in_features, out_features)); InvalidAdapter, naming the file or tensor, when it does not fit."""
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise InvalidAdapter(f"adapter {name!r}: {path} must hold {CONFIG_FILE} and {WEIGHTS_FILE} (PEFT's "
                             "format; pickled weights are not read)")
    config_bytes, weights_bytes = config_file.read_bytes(), weights_file.read_bytes()
    try:
        config = json.loads(config_bytes)
        tensors = load_file(str(weights_file))
    except (ValueError, OSError, SafetensorError) as exc:
        raise InvalidAdapter(f"adapter {name!r}: cannot read {path}: {exc}") from None
    rank, scale = _rank_and_scale(name, config, max_rank)
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise InvalidAdapter(f"adapter {name!r}: tensor {key} adapts nothing served (LoRA A/B of a decoder "
                                 f"layer's {', '.join(TARGETS)} or {', '.join(FUSED_PROJECTIONS)} only)")
        layer, module, side = int(m[1]), m[3], m[4]
        if module not in TARGETS and module not in FUSED_PROJECTIONS:
            raise InvalidAdapter(f"adapter {name!r}: tensor {key} targets {module}, which is not served (targets: "
                                 f"{', '.join(TARGETS)})")
        pairs.setdefault((layer, module), {})[side] = (key, t)
    weights: dict[Module, tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            missing = "lora_B" if "A" in sides else "lora_A"
            raise InvalidAdapter(f"adapter {name!r}: layer {layer} {module} has no {missing} weight")
        for part, b in _split(name, layer, module, sides, projections):
            weights[(layer, part)] = _checked(name, sides["A"], (sides["B"][0], b), rank,
                                              projections[(layer, part)], scale)
    if not weights:
        raise InvalidAdapter(f"adapter {name!r}: {weights_file} holds no LoRA weights")
    fingerprint = hashlib.blake2b(config_bytes + weights_bytes, digest_size=16).digest()
    return LoraAdapter(name, path, rank, scale, weights, fingerprint)


def _rank_and_scale(name: str, config: dict, max_rank: int) -> tuple[int, float]:
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidAdapter(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, plain in _PLAIN.items():
        if config.get(key, plain) not in (plain, None, {}, False, "none"):
            raise InvalidAdapter(f"adapter {name!r}: adapter_config.json {key}={config[key]!r} is not served")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in TARGETS and t not in FUSED_PROJECTIONS]
        if unknown:
            raise InvalidAdapter(f"adapter {name!r}: target_modules {unknown} are not served (targets: "
                                 f"{', '.join(TARGETS)})")
    rank = config.get("r")
    if not isinstance(rank, int) or not 0 < rank <= max_rank:
        raise InvalidAdapter(f"adapter {name!r}: r={rank!r}, the server takes ranks 1..{max_rank} (max_lora_rank)")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise InvalidAdapter(f"adapter {name!r}: lora_alpha={alpha!r} is not a number")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _split(name: str, layer: int, module: str, sides: dict, projections: dict[Module, tuple[int, int]]):
    """(projection, B) for each projection the adapted module stands for: itself, or a fused module's parts, each
    with its rows of B (A is shared)."""
    b_key, b = sides["B"]
    parts = FUSED_PROJECTIONS.get(module, (module,))
    for part in parts:
        if (layer, part) not in projections:
            raise InvalidAdapter(f"adapter {name!r}: tensor {sides['A'][0]} adapts layer {layer}'s {part}, which the "
                                 f"base model does not have (a different base model?)")
    widths = [projections[(layer, part)][1] for part in parts]
    if b.dim() != 2 or b.shape[0] != sum(widths):
        raise InvalidAdapter(f"adapter {name!r}: tensor {b_key} has shape {tuple(b.shape)}, expected "
                             f"({sum(widths)}, r) for the base model (a different base model?)")
    return list(zip(parts, b.split(widths), strict=True))


def _checked(name: str, a: tuple[str, torch.Tensor], b: tuple[str, torch.Tensor], rank: int,
             features: tuple[int, int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A and the scaled B, each (key, tensor) checked against the rank and the projection's (in, out) features."""
    n_in, n_out = features
    for (key, t), expected in ((a, (rank, n_in)), (b, (n_out, rank))):
        if tuple(t.shape) != expected or not t.is_floating_point() or not torch.isfinite(t).all():
            raise InvalidAdapter(f"adapter {name!r}: tensor {key} has shape {tuple(t.shape)} ({t.dtype}), expected a "
                                 f"finite float tensor of shape {expected} (r={rank}, the base model's "
                                 f"({n_out}, {n_in}) projection)")
    return a[1].float().contiguous(), (b[1].float() * scale).contiguous()
