"""Serve configs for the stacks that e2e modules start of their own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from genserve.services.common.deploy_config import LOCAL_PATH

# The session stack's drain time (`--drain-seconds`): its last module (tests/e2e/test_e2e_drain.py) ends it with
# SIGTERM while 8 streams are in flight, which a busy machine must fit them in.
DRAIN_S = 40.0


def serve_config(folder: Path, apps: tuple[str, ...], args: dict[str, dict[str, Any]] | None = None,
                 one_replica: tuple[str, ...] = ()) -> Path:
    """`make serve`'s config with only `apps` deployed, `args` (app -> settings) added to theirs and the apps in
    `one_replica` held to one replica, written to folder/serve.yaml: a stack of one module's own starts no replica
    that its tests never call."""
    config = yaml.safe_load(LOCAL_PATH.read_text())
    config["applications"] = [app for app in config["applications"] if app["name"] in apps]
    for app in config["applications"]:
        app["args"].update((args or {}).get(app["name"], {}))
        if app["name"] in one_replica:
            for deployment in app["deployments"]:
                deployment["autoscaling_config"].update(min_replicas=1, max_replicas=1)
    path = folder / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path
