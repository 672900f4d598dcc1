"""The text app's LoRA adapter names, shared by all its replicas: one small deployment of the app, bound only when
the serve config has a `lora` block.

Each text replica keeps its own adapter registry (weights in its own memory, services/text/engine/adapters.py);
this deployment is the one record of which name stands for which folder. An admin load is read and checked on the
replica it reaches, then recorded here; an unload is removed here first. A replica asked for an adapter looks its
name up here on every such request and brings its own registry in line (loads the folder, or forgets the name), so
a load or an unload reaches every replica, also one started later by autoscaling, without a broadcast, and no
replica serves an adapter that was unloaded elsewhere (docs/architecture.md, "LoRA adapters across replicas").
"""

from __future__ import annotations

from ray import serve


@serve.deployment(name="AdapterNames", num_replicas=1, max_ongoing_requests=1024,
                  ray_actor_options={"num_cpus": 0.01})
class AdapterNames:
    """name -> resolved folder. Seeded with the serve config's adapters; lives as long as the app's deployment (a
    redeploy with other `lora` args starts it again from those)."""

    def __init__(self, folders: dict[str, str]):
        self._folders = dict(folders)

    def folder(self, name: str) -> str | None:
        return self._folders.get(name)

    def set(self, name: str, folder: str) -> list[str]:
        self._folders[name] = folder
        return sorted(self._folders)

    def remove(self, name: str) -> bool:
        """Whether `name` was there."""
        return self._folders.pop(name, None) is not None

    def names(self) -> list[str]:
        return sorted(self._folders)
