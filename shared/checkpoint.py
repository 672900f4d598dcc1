"""One on-disk format for every genserve model: ``config.json`` + ``model.safetensors``.

Training, serving and tests share these two functions, so a checkpoint written by ``genserve train`` is
exactly what a service loads. Only safetensors is read: pickled weights are never loaded.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

C = TypeVar("C")


def save_checkpoint(directory: str | Path, model: nn.Module, config: Any, extra: dict | None = None) -> Path:
    """Write ``config.json`` (the dataclass ``config`` plus ``extra``) and ``model.safetensors`` into ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    payload = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    if extra:
        payload.update(extra)
    (out / CONFIG_NAME).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    # Tied or shared parameters would be saved twice; safetensors refuses aliased storage, so clone.
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_NAME))
    return out


def read_config(directory: str | Path, config_cls: type[C]) -> C:
    """Build ``config_cls`` from ``config.json``, ignoring keys the dataclass does not declare (e.g. ``extra``)."""
    raw = json.loads((Path(directory) / CONFIG_NAME).read_text())
    names = {f.name for f in dataclasses.fields(config_cls)}
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in names}
    return config_cls(**kwargs)


def read_extra(directory: str | Path) -> dict:
    """The whole ``config.json`` as a dict (training metadata lives next to the model config)."""
    return json.loads((Path(directory) / CONFIG_NAME).read_text())


def load_weights(directory: str | Path, model: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """Load ``model.safetensors`` into ``model`` strictly; refuse directories that only hold pickled weights."""
    path = Path(directory) / WEIGHTS_NAME
    if not path.exists():
        pickled = [p.name for p in Path(directory).glob("*") if p.suffix in {".bin", ".pt", ".pth", ".ckpt"}]
        hint = f" (found pickled {', '.join(pickled)}; genserve never loads pickle)" if pickled else ""
        raise FileNotFoundError(f"{path} not found{hint}")
    model.load_state_dict(load_file(str(path), device=str(device)), strict=True)
    return model


def read_safetensors_dir(directory: str | Path, stems: tuple[str, ...], device: str | torch.device = "cpu"
                         ) -> dict[str, torch.Tensor]:
    """Every tensor of ``<stem>.safetensors`` (or its shards, listed in ``<stem>.safetensors.index.json``) for the
    first stem present in ``directory``: the layout of diffusers' and transformers' ``save_pretrained``. Pickled
    weights are refused by name."""
    directory = Path(directory)
    for stem in stems:
        single, index = directory / f"{stem}.safetensors", directory / f"{stem}.safetensors.index.json"
        if single.is_file():
            return load_file(str(single), device=str(device))
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(load_file(str(directory / shard), device=str(device)))
            return state
    pickled = [p.name for p in directory.glob("*") if p.suffix in {".bin", ".pt", ".pth", ".ckpt"}]
    hint = f" (found pickled {', '.join(pickled)}; genserve never loads pickle)" if pickled else ""
    raise FileNotFoundError(f"{directory}: no {' or '.join(s + '.safetensors' for s in stems)}{hint}")


def load_state_strict(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> nn.Module:
    """load_state_dict(strict=True) with every missing and unexpected name in one error that names ``where``."""
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not fit the architecture its config describes; missing "
                         f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                         f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # a shape mismatch: name the file, keep torch's per-tensor detail
        raise ValueError(f"{where}: {exc}") from exc
    return model


def supported(raw: dict, key: str, default: Any, allowed: tuple, where: str) -> Any:
    """``raw[key]`` (``default`` when absent or null) if it is one of ``allowed``; otherwise a ValueError naming
    the file and the key, for configs that ask for something genserve does not implement."""
    value = raw.get(key)
    value = default if value is None else value
    if value not in allowed:
        raise ValueError(f"{where}: {key}={value!r} is not supported (supported: {', '.join(map(repr, allowed))})")
    return value
