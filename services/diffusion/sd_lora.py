"""LoRA files for a Stable-Diffusion-format pipeline, read the way diffusers' ``load_lora_weights`` reads them, onto our
U-Net (shared/blocks/unet.py) and CLIP text encoder (shared/blocks/clip_text.py). safetensors only: a pickle is never
opened.

The namings read (the facts are diffusers' loaders/lora_pipeline.py, lora_conversion_utils.py and
utils/state_dict_utils.py; the code is ours):
- PEFT's, which ``save_lora_weights`` writes: ``unet.<module>.lora_A.weight`` (r, in) and ``...lora_B.weight``
  (out, r), ``text_encoder.<module>...`` for the text encoder (transformers' module names, with or without
  ``text_model.``). The rank and alpha per part come from the file's ``lora_adapter_metadata`` header (peft's
  LoraConfig: ``r``, ``lora_alpha``, ``rank_pattern``, ``alpha_pattern``, ``use_rslora``); without one, alpha = r
  (scale 1), as diffusers takes it.
- diffusers' older ones, scale 1: ``<module>.lora.down.weight`` / ``.lora.up.weight``, ``<module>.lora_linear_layer.
  down.weight``, and the attention-processor form ``attn1.processor.to_q_lora.down.weight`` (``to_out_lora`` is
  ``to_out.0``; in the text encoder ``to_q_lora`` is ``q_proj`` and ``to_out_lora`` is ``out_proj``).
- Kohya's (sd-scripts, A1111), when every key is one: ``lora_unet_<module, "." spelled "_">.lora_down.weight``,
  ``.lora_up.weight`` and ``.alpha``, and ``lora_te_`` or ``lora_te1_`` for the text encoder. The scale is alpha / r
  per layer (1 without an alpha). Underscores are ambiguous, so a name is read by matching the model's own module
  names spelled that way, which is what diffusers' converter spells out rule by rule for these layers.

The layers a file may adapt: in the U-Net's transformers, attention ``to_q``/``to_k``/``to_v``/``to_out.0`` (attn1 and
attn2), the GEGLU feedforward ``ff.net.0.proj``/``ff.net.2`` and ``proj_in``/``proj_out`` (a 1×1 conv's LoRA, (r, in,
1, 1), is the same map); in the text encoder, ``q_proj``/``k_proj``/``v_proj``/``out_proj`` and ``mlp.fc1``/``fc2``.
Anything else (convolutions, time embeddings, a second text encoder, DoRA, LoRA biases) and any tensor of the wrong
shape is refused, naming the tensor and what was expected. The per-layer scale is folded into B here; a request's
own scale multiplies the delta when it runs (services/diffusion/lora_rows.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from genserve.services.diffusion.params import InvalidLora

# diffusers' LoRA file in a folder (LORA_WEIGHT_NAME_SAFE); a folder without it may hold one other .safetensors file.
WEIGHT_NAME = "pytorch_lora_weights.safetensors"
METADATA_KEY = "lora_adapter_metadata"  # diffusers' safetensors header entry: {"unet.r": ..., "text_encoder.r": ...}
PARTS = ("unet", "text_encoder")
_UNET_TARGET = re.compile(
    r"attentions\.\d+\.(proj_in|proj_out|transformer_blocks\.\d+\.(attn[12]\.to_(q|k|v|out\.0)|ff\.net\.(0\.proj|2)))$")
_TEXT_TARGET = re.compile(r"^layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.fc[12])$")
_DIFFUSERS_KEY = re.compile(r"^(?P<module>.+?)(?:\.lora_(?P<peft>[AB])|\.lora\.(?P<old>down|up)"
                            r"|\.lora_linear_layer\.(?P<linear>down|up)|_lora\.(?P<processor>down|up))\.weight$")
_KOHYA_KEY = re.compile(r"^(?P<name>lora_(?:unet|te|te1|te2)_\w+)\.(?P<what>lora_down\.weight|lora_up\.weight|alpha)$")
_KOHYA_PARTS = {"lora_unet_": "unet", "lora_te_": "text_encoder", "lora_te1_": "text_encoder"}
# The attention-processor form names the projection of the layer; in the text encoder, by CLIP's names.
_PROCESSOR = {"unet": {"to_q": "to_q", "to_k": "to_k", "to_v": "to_v", "to_out": "to_out.0"},
              "text_encoder": {"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "out_proj"}}

Delta = tuple[torch.Tensor, torch.Tensor]  # A (r, in) and B (out, r) with the layer's alpha / r folded in


@dataclass(frozen=True)
class SdTargets:
    """The layers of one pipeline a LoRA may adapt: per part, our module name -> (in_features, out_features), and the
    names a file may call each by (transformers' for the text encoder; diffusers' for the U-Net are ours)."""

    unet: dict[str, tuple[int, int]]
    text_encoder: dict[str, tuple[int, int]]
    aliases: dict[str, dict[str, str]]  # part -> file's module name -> ours

    @classmethod
    def of(cls, unet: nn.Module, text_encoder: nn.Module) -> SdTargets:
        found: dict[str, dict[str, tuple[int, int]]] = {}
        for part, model, pattern in (("unet", unet, _UNET_TARGET), ("text_encoder", text_encoder, _TEXT_TARGET)):
            found[part] = {name: (m.in_features, m.out_features) for name, m in model.named_modules()
                           if isinstance(m, nn.Linear) and pattern.search(name)}
        text_names = {}
        for ours in found["text_encoder"]:
            hf = "encoder." + ours.replace(".o_proj", ".out_proj")  # transformers' CLIPTextModel names
            text_names[hf] = text_names["text_model." + hf] = ours
        return cls(found["unet"], found["text_encoder"], {"unet": {n: n for n in found["unet"]},
                                                          "text_encoder": text_names})

    def shapes(self, part: str) -> dict[str, tuple[int, int]]:
        return self.unet if part == "unet" else self.text_encoder


@dataclass(frozen=True, eq=False)
class SdLora:
    """A loaded LoRA: per part, our module name -> (A, scaled B), on the pipeline's device."""

    name: str
    path: Path
    unet: dict[str, Delta]
    text_encoder: dict[str, Delta]


@dataclass
class _Pair:
    """One adapted layer as the file holds it: its tensors by role ("A", "B") with their keys, and Kohya's alpha."""

    file_module: str  # the module's name in the file's own naming (what peft's rank/alpha patterns match)
    tensors: dict[str, tuple[str, torch.Tensor]]
    alpha: float | None = None


def lora_file(path: Path) -> Path:
    """The safetensors file of a LoRA at ``path``: the file itself, or a folder's ``pytorch_lora_weights.safetensors``
    (else its only .safetensors file)."""
    if path.is_dir():
        if (path / WEIGHT_NAME).is_file():
            return path / WEIGHT_NAME
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            raise InvalidLora(f"{path} must hold {WEIGHT_NAME} or exactly one .safetensors file, found "
                              f"{len(files)}")
        return files[0]
    if path.suffix != ".safetensors" or not path.is_file():
        raise InvalidLora(f"{path}: a LoRA is a .safetensors file or a folder holding one (pickles are not read)")
    return path


def load_sd_lora(name: str, path: Path, targets: SdTargets, max_rank: int,
                 device: torch.device | str = "cpu") -> SdLora:
    """Read the LoRA at ``path`` for a pipeline whose adaptable layers are ``targets``; InvalidLora naming the
    tensor (and the shape expected) or the file when it does not fit."""
    file = lora_file(path)
    try:
        with safe_open(str(file), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        metadata = json.loads(header[METADATA_KEY]) if METADATA_KEY in header else None
    except (SafetensorError, OSError, ValueError) as exc:
        raise InvalidLora(f"LoRA {name!r}: cannot read {file}: {exc}") from None
    if not tensors:
        raise InvalidLora(f"LoRA {name!r}: {file} holds no tensors")
    kohya = all(key.startswith(("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_")) for key in tensors)
    pairs = _kohya_pairs(tensors, targets) if kohya else _diffusers_pairs(tensors, targets)
    parts: dict[str, dict[str, Delta]] = {part: {} for part in PARTS}
    for (part, module), pair in sorted(pairs.items()):
        options = None if kohya else _part_options(metadata, part)
        a, b = _checked(pair, targets.shapes(part)[module], options, max_rank)
        scale = _scale(pair, a.shape[0], options)
        parts[part][module] = (a.float().to(device), (b.float() * scale).to(device))
    return SdLora(name, path, parts["unet"], parts["text_encoder"])


def _diffusers_pairs(tensors: dict[str, torch.Tensor], targets: SdTargets) -> dict[tuple[str, str], _Pair]:
    pairs: dict[tuple[str, str], _Pair] = {}
    for key, tensor in tensors.items():
        part, _, rest = key.partition(".")
        m = _DIFFUSERS_KEY.match(rest.replace(".processor.", "."))
        if part not in PARTS or m is None:
            raise InvalidLora(f"tensor {key} is no LoRA weight this pipeline reads: diffusers' unet.<layer>.lora_A/"
                              "lora_B (or .lora.down/up) and text_encoder.<layer>..., or Kohya's lora_unet_/lora_te_ "
                              "names throughout (DoRA, LoRA biases and SDXL's second text encoder are not served)")
        module, which = m["module"], m["peft"] or m["old"] or m["linear"] or m["processor"]
        role = "A" if which in ("A", "down") else "B"
        if m["processor"]:  # attn1.to_q_lora.down: the projection is named by its attention-processor alias
            parent, _, proj = module.rpartition(".")
            if proj not in _PROCESSOR[part]:
                raise InvalidLora(f"tensor {key}: {proj}_lora names no attention projection "
                                  f"({', '.join(_PROCESSOR[part])})")
            module = f"{parent}.{_PROCESSOR[part][proj]}"
        _add(pairs, part, module, targets, key, role, tensor)
    return pairs


def _kohya_pairs(tensors: dict[str, torch.Tensor], targets: SdTargets) -> dict[tuple[str, str], _Pair]:
    spelled = {part: {name.replace(".", "_"): name for name in targets.aliases[part]} for part in PARTS}
    pairs: dict[tuple[str, str], _Pair] = {}
    alphas: dict[tuple[str, str], tuple[str, float]] = {}
    for key, tensor in tensors.items():
        m = _KOHYA_KEY.match(key)
        prefix = next((p for p in _KOHYA_PARTS if m is not None and m["name"].startswith(p)), None)
        if prefix is None:
            raise InvalidLora(f"tensor {key} is no Kohya LoRA weight this pipeline reads: <lora_unet_|lora_te_|"
                              "lora_te1_><layer>.lora_down.weight, .lora_up.weight or .alpha (DoRA, LoHa/LoKr and "
                              "SDXL's second text encoder, lora_te2_, are not served)")
        part = _KOHYA_PARTS[prefix]
        module = spelled[part].get(m["name"][len(prefix):])
        if module is None:
            raise InvalidLora(f"tensor {key}: {m['name']} is no layer a LoRA may adapt in this pipeline's "
                              f"{part} ({_layer_kinds(part)}; SDXL's input_blocks/output_blocks names are not read)")
        if m["what"] == "alpha":
            alphas[(part, targets.aliases[part][module])] = (key, float(tensor.float().reshape(-1)[0]))
        else:
            _add(pairs, part, module, targets, key, "A" if m["what"] == "lora_down.weight" else "B", tensor)
    for where, (key, alpha) in alphas.items():
        if where not in pairs:
            raise InvalidLora(f"tensor {key} is an alpha without its lora_down and lora_up weights")
        pairs[where].alpha = alpha
    return pairs


def _add(pairs: dict[tuple[str, str], _Pair], part: str, file_module: str, targets: SdTargets, key: str, role: str,
         tensor: torch.Tensor) -> None:
    ours = targets.aliases[part].get(file_module)
    if ours is None:
        raise InvalidLora(f"tensor {key} adapts {part}.{file_module}, which is no layer a LoRA may adapt in this "
                          f"pipeline ({_layer_kinds(part)})")
    pair = pairs.setdefault((part, ours), _Pair(file_module, {}))
    if role in pair.tensors:
        raise InvalidLora(f"tensor {key} adapts the same layer as {pair.tensors[role][0]}")
    pair.tensors[role] = (key, tensor)


def _layer_kinds(part: str) -> str:
    if part == "unet":
        return "the transformers' attn1/attn2 to_q, to_k, to_v, to_out.0, ff.net.0.proj, ff.net.2, proj_in, proj_out"
    return "the text encoder's self_attn q_proj, k_proj, v_proj, out_proj and mlp.fc1, fc2"


def _checked(pair: _Pair, shape: tuple[int, int], options: dict | None, max_rank: int) -> Delta:
    """A (r, in) and B (out, r) of one layer, shapes checked against the layer (in, out) and the file's rank."""
    n_in, n_out = shape
    for role, other in (("A", "B"), ("B", "A")):
        if role not in pair.tensors:
            raise InvalidLora(f"tensor {pair.tensors[other][0]} has no {'lora_B/up' if role == 'B' else 'lora_A/down'}"
                              " weight beside it")
    (key_a, a), (key_b, b) = pair.tensors["A"], pair.tensors["B"]
    a, b = _as_matrix(a), _as_matrix(b)  # a 1×1 conv's LoRA (proj_in/proj_out of SD 1.x) is the same map
    r = (a.shape or (0,))[0] if options is None else \
        int(_pattern_value(options.get("rank_pattern") or {}, pair.file_module, options.get("r", 8)))
    if a.dim() != 2 or tuple(a.shape) != (r, n_in):
        raise InvalidLora(f"tensor {key_a} has shape {tuple(pair.tensors['A'][1].shape)}, expected ({r}, {n_in})")
    if r > max_rank:
        raise InvalidLora(f"tensor {key_a} has rank {r}, more than max_rank ({max_rank})")
    if b.dim() != 2 or tuple(b.shape) != (n_out, r):
        raise InvalidLora(f"tensor {key_b} has shape {tuple(pair.tensors['B'][1].shape)}, expected ({n_out}, {r})")
    return a, b


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    return t[:, :, 0, 0] if t.dim() == 4 and t.shape[2:] == (1, 1) else t


def _part_options(metadata: dict | None, part: str) -> dict | None:
    """The peft LoraConfig that diffusers' header holds for ``part`` (keys ``unet.r`` ...), or None without one."""
    if metadata is None:
        return None
    options = {k[len(part) + 1:]: v for k, v in metadata.items() if k.startswith(part + ".")}
    if not options:  # a header for the other part only: this one's rank is its tensors', its alpha that rank
        return None
    for key, plain in (("use_dora", False), ("lora_bias", False)):
        if options.get(key, plain) != plain:
            raise InvalidLora(f"{METADATA_KEY}: {part}.{key}={options[key]!r} is not served (only {plain})")
    return options


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """peft's rank_pattern/alpha_pattern lookup: the first key that matches the end of the module's dotted name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _scale(pair: _Pair, r: int, options: dict | None) -> float:
    """alpha / r of one layer (alpha / sqrt(r) with rsLoRA): Kohya's alpha, the header's, or r (scale 1)."""
    if options is None:
        return 1.0 if pair.alpha is None else pair.alpha / r
    alpha = _pattern_value(options.get("alpha_pattern") or {}, pair.file_module, options.get("lora_alpha", 8))
    return alpha / (math.sqrt(r) if options.get("use_rslora") else r)
