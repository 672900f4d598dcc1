"""The app builder: what a serve config's `import_path: services.<svc>.app:build` and `args:` turn into.

Every app takes `model_dir` (a checkpoint directory; when empty, the env var GENSERVE_<SVC>_MODEL, and when that is
unset too, the model's committed demo weights; the `vae` app first falls back to the `vae/` of a Stable Diffusion
folder that GENSERVE_DIFFUSION_MODEL names, so the two apps serve one pipeline); an app with settings of its own
extends `AppArgs` (the text app: services/text/settings.py). Every app also takes `rate_limits`
(services/common/rate_limit.py, off by default). Unknown or invalid args fail the deploy with the field named.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.deployment import Application, Deployment

from .rate_limit import RateLimits


class AppArgs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_dir: str | None = None
    rate_limits: RateLimits = RateLimits()  # per caller and replica (services/common/rate_limit.py); default off
    # torch's and the C kernels' threads per replica (services/common/device.py); None keeps Ray's floor(num_cpus)
    torch_threads: int | None = Field(None, ge=1, le=1024)


def model_dir_env(service: str) -> str:
    return f"GENSERVE_{service.upper()}_MODEL"


def pipeline_vae_dir(diffusion_dir: str | None) -> str | None:
    """``DIR/vae`` when ``DIR`` is a diffusers pipeline folder (it has model_index.json), else None."""
    if diffusion_dir and (Path(diffusion_dir) / "model_index.json").is_file():
        return str(Path(diffusion_dir) / "vae")
    return None


def resolve_model_dir(service: str, configured: str | None) -> str | None:
    """The checkpoint directory to load: the configured one, else the env var, else (vae only) the vae/ of the
    diffusion app's diffusers folder, else None (demo weights)."""
    found = configured or os.environ.get(model_dir_env(service)) or None
    if found is None and service == "vae":
        return pipeline_vae_dir(os.environ.get(model_dir_env("diffusion")))
    return found


def build_app(service: str, deployment: Deployment, args: dict[str, Any] | None,
              args_model: type[AppArgs] = AppArgs, *bound: Application) -> Application:
    """Bind `deployment` to its model directory, its validated settings (rate limits, and the app's own) and the
    other deployments of its app in `bound` (their handles)."""
    parsed = args_model.model_validate(args or {})
    return deployment.bind(resolve_model_dir(service, parsed.model_dir), parsed, *bound)


def handle_to(app_name: str) -> Any:
    """A deployment handle to another application's ingress (serve.get_app_handle), for composition."""
    return serve.get_app_handle(app_name)
