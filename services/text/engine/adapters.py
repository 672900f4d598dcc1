"""The engine's LoRA adapters by name: loaded and unloaded at run time, from folders under one root only, at most
``max_cpu_loras`` of them in memory (least recently used evicted past that), at most ``max_loras`` in one batch.

A name stays registered until unloaded; its weights may be evicted from memory and are read again from its folder
when a request next names it (as vLLM's LRU adapter cache does). A queued or running request holds its adapter's
weights (``acquire``/``release``), so an adapter in use is never evicted; when every adapter in memory is in use,
one more cannot be held and ``AdapterCapacityExceeded`` says so (RESOURCE_EXHAUSTED, retry later). An unloaded or
replaced adapter's requests already queued finish with the weights they started with.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from genserve.services.text.engine.params import AdapterCapacityExceeded, AdapterNotFound, InvalidAdapter
from genserve.services.text.lora import LoraAdapter, Module, load_adapter

MAX_NAME = 128


@dataclass(frozen=True)
class LoraConfig:
    root: str = ""  # adapters load only from folders under this one; "" refuses every load
    max_loras: int = 4  # distinct adapters in one batch: the runner's slots
    max_cpu_loras: int = 8  # adapters whose weights stay in memory
    max_lora_rank: int = 16
    adapters: tuple[tuple[str, str], ...] = ()  # (name, folder) pairs loaded at start

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_cpu_loras", "max_lora_rank"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"lora.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"lora.max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")


class AdapterRegistry:
    """Adapters by name for a base model whose adaptable projections are ``projections`` ((layer, name) ->
    (in_features, out_features))."""

    def __init__(self, config: LoraConfig, projections: dict[Module, tuple[int, int]]):
        self.config = config
        self.root = Path(config.root).resolve() if config.root else None
        self.projections = projections
        self._folders: dict[str, Path] = {}
        self._memory: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._users: dict[int, int] = {}  # id(adapter) -> queued or running requests holding it

    def names(self) -> list[str]:
        return sorted(self._folders)

    def folders(self) -> dict[str, Path]:
        """Each registered adapter's resolved folder, by name."""
        return dict(self._folders)

    def folder(self, path: str | Path) -> Path:
        """``path`` (relative to the root, or absolute) resolved, symlinks included; InvalidAdapter when it is not
        under the root."""
        if self.root is None:
            raise InvalidAdapter("no adapter root is configured: adapters cannot be loaded")
        folder = (self.root / path).resolve()
        if not folder.is_relative_to(self.root):
            raise InvalidAdapter(f"adapter path {str(path)!r} is outside the adapter root {self.root}")
        return folder

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Read the adapter in ``path`` and register it as ``name`` (replacing an adapter of that name)."""
        if not isinstance(name, str) or not name or len(name) > MAX_NAME or name != name.strip():
            raise InvalidAdapter(f"adapter name must be 1..{MAX_NAME} characters without surrounding spaces, "
                                 f"got {name!r}")
        folder = self.folder(path)
        self._make_room(name)
        adapter = load_adapter(name, folder, self.projections, self.config.max_lora_rank)
        self._folders[name] = folder
        self._memory[name] = adapter
        self._memory.move_to_end(name)
        return adapter

    def unload(self, name: str) -> None:
        if name not in self._folders:
            raise AdapterNotFound(f"adapter {name!r} is not loaded")
        del self._folders[name]
        self._memory.pop(name, None)

    def acquire(self, name: str) -> LoraAdapter:
        """The weights of adapter ``name`` for one more request (read again if evicted); AdapterNotFound."""
        if name not in self._folders:
            raise AdapterNotFound(f"adapter {name!r} is not loaded")
        adapter = self._memory.get(name)
        if adapter is None:
            self._make_room(name)
            adapter = load_adapter(name, self._folders[name], self.projections, self.config.max_lora_rank)
            self._memory[name] = adapter
        self._memory.move_to_end(name)
        self._users[id(adapter)] = self._users.get(id(adapter), 0) + 1
        return adapter

    def release(self, adapter: LoraAdapter) -> None:
        """A request holding ``adapter`` has finished."""
        left = self._users.get(id(adapter), 0) - 1
        if left > 0:
            self._users[id(adapter)] = left
        else:
            self._users.pop(id(adapter), None)

    def _make_room(self, name: str) -> None:
        """Evict the least recently used adapters nobody holds until one more (``name``) fits."""
        self._memory.pop(name, None)  # a replaced adapter's requests keep their own reference
        while len(self._memory) >= self.config.max_cpu_loras:
            idle = next((n for n, a in self._memory.items() if id(a) not in self._users), None)
            if idle is None:
                raise AdapterCapacityExceeded(
                    f"cannot hold adapter {name!r}: all {self.config.max_cpu_loras} adapters in memory "
                    "(max_cpu_loras) are in use by queued requests")
            del self._memory[idle]
