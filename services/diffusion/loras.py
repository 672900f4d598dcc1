"""A pipeline's LoRAs by name: loaded at start from the serve config and at run time (`load`, `unload`), from files or
folders under one root only, at most `max_loras` of them, every one kept in memory (an SD 1.x LoRA is a few MiB to
a few hundred; past the cap a load is refused with LoraCapacityExceeded).

A request picks one by name with its scale (`use`). It holds the weights themselves, so unloading or replacing a
name leaves the requests already running on it to finish with the weights they started with.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from genserve.services.diffusion.components import DiffusionComponents
from genserve.services.diffusion.lora_rows import RowGroup, RowLoras
from genserve.services.diffusion.params import LORA_NAME, InvalidLora, LoraCapacityExceeded, LoraNotFound
from genserve.services.diffusion.sd_lora import SdLora, SdTargets, load_sd_lora
from genserve.shared.blocks.clip_text import CLIPTextTransformer
from genserve.shared.blocks.unet import UNet


@dataclass(frozen=True)
class LoraConfig:
    root: str  # LoRAs load only from under this folder
    max_loras: int = 16  # loaded at once
    max_rank: int = 128
    load: tuple[tuple[str, str], ...] = ()  # (name, path under root) loaded at start

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_rank"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"loras.{name} must be a positive integer, got {getattr(self, name)!r}")
        if not Path(self.root).is_dir():
            raise ValueError(f"loras.root: {self.root!r} is not a folder")
        if len(self.load) > self.max_loras:
            raise ValueError(f"loras.load lists {len(self.load)} LoRAs, more than max_loras ({self.max_loras})")


@dataclass(frozen=True)
class LoraUse:
    """One request's LoRA and scale."""

    lora: SdLora
    scale: float

    def unet_group(self, start: int, stop: int) -> RowGroup:
        return RowGroup(start, stop, self.lora.unet, self.scale)

    def text_group(self, rows: int) -> RowGroup:
        return RowGroup(0, rows, self.lora.text_encoder, self.scale)


class LoraRegistry:
    """The LoRAs of a Stable-Diffusion-format pipeline's ``parts``, on ``device``; ``unet_rows`` and ``text_rows`` apply
    them per group of rows."""

    def __init__(self, parts: DiffusionComponents, config: LoraConfig, device: torch.device | str = "cpu") -> None:
        if not isinstance(parts.unet, UNet) or not isinstance(parts.text_encoder, CLIPTextTransformer):
            raise ValueError("loras: LoRAs are served for Stable-Diffusion-format pipelines (a U-Net and one CLIP "
                             "text encoder) only")
        self.config, self.device = config, device
        self.root = Path(config.root).resolve()
        self.targets = SdTargets.of(parts.unet, parts.text_encoder)
        self.unet_rows = RowLoras(parts.unet, self.targets.unet)
        self.text_rows = RowLoras(parts.text_encoder, self.targets.text_encoder)
        self._loras: dict[str, SdLora] = {}
        self._lock = threading.Lock()  # loads run in worker threads; requests read from others
        for name, path in config.load:
            self.load(name, path)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._loras)

    def path(self, path: str | Path) -> Path:
        """``path`` (relative to the root, or absolute) resolved, symlinks included; InvalidLora when it is not under
        the root."""
        resolved = (self.root / path).resolve()
        if not resolved.is_relative_to(self.root):
            raise InvalidLora(f"LoRA path {str(path)!r} is outside the LoRA root {self.root}")
        if not resolved.exists():
            raise InvalidLora(f"LoRA path {str(path)!r} does not exist under {self.root}")
        return resolved

    def load(self, name: str, path: str | Path) -> SdLora:
        """Read the LoRA at ``path`` and serve it as ``name`` (replacing a LoRA of that name)."""
        if not isinstance(name, str) or not re.fullmatch(LORA_NAME, name):
            raise InvalidLora(f"LoRA name must match {LORA_NAME}, got {name!r}")
        with self._lock:
            self._room_for(name)  # before reading a file that could not be kept
        lora = load_sd_lora(name, self.path(path), self.targets, self.config.max_rank, self.device)
        with self._lock:
            self._room_for(name)  # another load may have taken the last place meanwhile
            self._loras[name] = lora
        return lora

    def _room_for(self, name: str) -> None:
        if name not in self._loras and len(self._loras) >= self.config.max_loras:
            raise LoraCapacityExceeded(f"cannot load LoRA {name!r}: {len(self._loras)} are loaded, the most this "
                                       "replica holds (max_loras)")

    def unload(self, name: str) -> None:
        with self._lock:
            if self._loras.pop(name, None) is None:
                raise LoraNotFound(f"LoRA {name!r} is not loaded")

    def use(self, name: str, scale: float) -> LoraUse:
        with self._lock:
            lora = self._loras.get(name)
        if lora is None:
            raise LoraNotFound(f"LoRA {name!r} is not loaded")
        return LoraUse(lora, scale)
