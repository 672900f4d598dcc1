"""Resumable training state for the image models (VAE, GAN): optimizer moments as safetensors, counters as JSON.

A run directory holds ``<name>.safetensors`` (every optimizer state tensor, keyed ``<optimizer>.<param>.<slot>``)
and ``<name>.json`` (step, images seen, wall time, the optimizers' param groups). Nothing is pickled.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save_train_state(directory: str | Path, optimizers: dict[str, torch.optim.Optimizer], counters: dict) -> None:
    """Write the optimizers' state and ``counters`` (JSON-serialisable) into ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors, groups = {}, {}
    for name, optimizer in optimizers.items():
        state = optimizer.state_dict()
        groups[name] = state["param_groups"]
        for index, slots in state["state"].items():
            for slot, value in slots.items():
                tensors[f"{name}.{index}.{slot}"] = torch.as_tensor(value).detach().cpu().contiguous().clone()
    save_file(tensors, str(out / "train_state.safetensors"))
    (out / "train_state.json").write_text(json.dumps({"counters": counters, "param_groups": groups}, indent=2) + "\n")


def has_train_state(directory: str | Path) -> bool:
    return (Path(directory) / "train_state.json").exists() and (Path(directory) / "train_state.safetensors").exists()


def load_train_state(directory: str | Path, optimizers: dict[str, torch.optim.Optimizer]) -> dict:
    """Restore the optimizers in place from ``directory``; return the saved counters."""
    meta = json.loads((Path(directory) / "train_state.json").read_text())
    tensors = load_file(str(Path(directory) / "train_state.safetensors"))
    for name, optimizer in optimizers.items():
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            owner, index, slot = key.split(".", 2)
            if owner == name:
                state.setdefault(int(index), {})[slot] = value
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"][name]})
    return meta["counters"]
