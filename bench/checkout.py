"""genserve from a checkout, uninstalled: what the GPU check machine's own Python runs (bench/gpu_device.sh). Imports
nothing but the standard library, so any Python can use it, torch or not."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def link_checkout(into: Path) -> None:
    """Make `genserve` importable from this checkout without installing it: `into`/genserve holds links to
    protos/genserve's files and to kernels/, shared/ and services/, as pyproject's package-dir maps them. `into` goes
    first on this process's path and on its children's (PYTHONPATH)."""
    package = into / "genserve"
    package.mkdir(parents=True)
    for item in (ROOT / "protos" / "genserve").iterdir():
        (package / item.name).symlink_to(item)
    for name in ("kernels", "shared", "services"):
        (package / name).symlink_to(ROOT / name)
    sys.path.insert(0, str(into))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(into), os.environ.get("PYTHONPATH")) if p)
