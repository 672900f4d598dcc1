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
