"""Load a text checkpoint: a Hugging Face directory (``config.json``, single or sharded ``*.safetensors`` with
``model.safetensors.index.json``) or a GGUF file (services/text/gguf.py), in the checkpoint dtype or a requested one.
Pickled weights are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from genserve.services.text.config import LlamaConfig, from_hf, to_hf
from genserve.services.text.gguf import GGUFCheckpoint, find_gguf
from genserve.services.text.hf_weights import to_model_names
from genserve.services.text.model import LlamaForCausalLM, make_local_rope, make_rope
from genserve.services.text.quantize import quantize_int8_
from genserve.shared.blocks.backend import Backend

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_config(directory: str | Path) -> LlamaConfig:
    path = Path(directory) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: not a model directory")
    return from_hf(json.loads(path.read_text()))


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards named by the index, else ``*.safetensors``."""
    root = Path(directory)
    index = root / INDEX_NAME
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (root / s).exists()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return [root / s for s in shards]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise ValueError(f"{root} holds only pickled weights ({', '.join(pickled)}); genserve loads safetensors "
                             "only, because unpickling can run arbitrary code. Convert the checkpoint to safetensors "
                             "(e.g. save_pretrained(..., safe_serialization=True)).")
        raise FileNotFoundError(f"no *.safetensors weights in {root}")
    return files


def load_state_dict(directory: str | Path, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read one at a time straight onto ``device`` and cast to ``dtype`` there."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt", device=str(torch.device(device))) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                state[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return state


def load_model(directory: str | Path | GGUFCheckpoint, dtype: str | None = "float32", backend: Backend | None = None,
               device: str | torch.device = "cpu", keep_quantized: bool = False) -> LlamaForCausalLM:
    """Build the model described by ``directory/config.json`` (or a GGUF file, a directory holding one, or an opened
    ``GGUFCheckpoint``) and load its weights strictly.

    ``dtype``: "float32" | "bfloat16" | "float16", or None for the checkpoint's own dtype (float32 for GGUF);
    "int8" loads float32 and quantises every linear layer to int8 weights (``genserve.services.text.quantize``).
    ``keep_quantized`` (GGUF only): projections and the LM head stored as Q8_0/Q4_0/Q4_1 stay in the file's blocks
    (QuantLinear, the product dequantises inside its kernel); the rest is in ``dtype``.
    """
    if dtype == "int8":
        model = quantize_int8_(load_model(directory, "float32", backend, device="cpu"))
        model.config = model.config.replace(dtype="int8")
        return model.to(device)
    checkpoint = directory if isinstance(directory, GGUFCheckpoint) else open_gguf(directory)
    if checkpoint is None:
        weight_files(directory)  # refuse pickle-only or empty directories before anything else
    cfg = checkpoint.config() if checkpoint is not None else read_config(directory)
    dtype_name = dtype or cfg.dtype
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or int8, got {dtype_name!r}")
    cfg = cfg.replace(dtype=dtype_name)
    kept = checkpoint.quantized_linears() if keep_quantized and checkpoint is not None else {}
    skip = frozenset(t.name for t in kept.values() if t.name != "token_embd.weight")  # the lookup stays dense
    state = checkpoint.state_dict(cfg, DTYPES[dtype_name], skip) if checkpoint is not None else \
        to_model_names(load_state_dict(directory, DTYPES[dtype_name], device), cfg)
    # HF saves rotary tables in some versions; they are derived, never weights.
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    # Built on the meta device, then given the loaded tensors themselves (assign): no random init, and no second
    # copy of the weights in another dtype or on another device (an fp32 build was 4 more bytes per parameter).
    rope = make_rope(cfg).to(device=device, dtype=DTYPES[dtype_name])  # derived tables, never in a checkpoint
    local_rope = make_local_rope(cfg)
    local_rope = local_rope.to(device=device, dtype=DTYPES[dtype_name]) if local_rope is not None else None
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, rope, local_rope)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys
               if not (cfg.tie_embeddings and k == "lm_head.weight") and k.removesuffix(".weight") not in kept]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint {directory} does not match {cfg.architecture}: missing {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
    if cfg.tie_embeddings and "lm_head" not in kept:
        model.lm_head.weight = model.model.embed_tokens.weight
    for name, tensor in kept.items():
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        dense = getattr(owner, attr)
        bias = None if dense.bias is None else dense.bias.detach().float()
        setattr(owner, attr, checkpoint.quant_linear(cfg, tensor, bias, model.backend, name))
    unloaded = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if unloaded:
        raise ValueError(f"checkpoint {directory} left {', '.join(unloaded[:5])} without values")
    return model.to(device).eval()


def open_gguf(path: str | Path) -> GGUFCheckpoint | None:
    """The GGUF checkpoint that `path` names (a file, or a directory holding one); None for a HF directory."""
    gguf_path = find_gguf(path)
    return GGUFCheckpoint.open(gguf_path) if gguf_path is not None else None


def save_model(directory: str | Path, model: LlamaForCausalLM, dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the HF layout (tied ``lm_head`` omitted)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous().clone() for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight")
    dtype_name = next(n for n, d in DTYPES.items() if d == next(iter(state.values())).dtype)
    (out / "config.json").write_text(json.dumps(to_hf(cfg.replace(dtype=dtype_name)), indent=2) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
