"""Serve configs for the stacks that e2e modules start of their own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from genserve.services.common.deploy_config import LOCAL_PATH


def serve_config(folder: Path, apps: tuple[str, ...], args: dict[str, dict[str, Any]] | None = None) -> Path:
    """`make serve`'s config with only `apps` deployed and `args` (app -> settings) added to theirs, written to
    folder/serve.yaml: a stack of one module's own starts no replica that its tests never call."""
    config = yaml.safe_load(LOCAL_PATH.read_text())
    config["applications"] = [app for app in config["applications"] if app["name"] in apps]
    for app in config["applications"]:
        app["args"].update((args or {}).get(app["name"], {}))
    path = folder / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path
