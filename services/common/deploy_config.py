"""The one module that writes both serve configs: `python -m genserve.services.common.deploy_config`.

- deploy/serve_config.local.yaml: CPU only, fractional `num_cpus`; all four apps at their maximum replica count,
  plus the health gateway, reserve at most 2 CPUs, so they fit a 2-core machine.
- deploy/serve_config.yaml: GPU nodes, each model replica holds a fraction of a GPU (`num_gpus`).

Each app gets its own autoscaling_config and max_ongoing_requests / max_queued_requests: past
max_ongoing_requests per replica, requests wait in the proxy's queue; past max_queued_requests the proxy answers
RESOURCE_EXHAUSTED at once instead of letting clients time out. Every deployment drains as `make serve` does
(services/common/drain.py): a replica that stops lets its calls run for up to DRAIN_SECONDS.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from .drain import DRAIN_SECONDS, SHUTDOWN_WAIT_LOOP_S

ROOT = Path(__file__).resolve().parents[2]
LOCAL_PATH = ROOT / "deploy" / "serve_config.local.yaml"
GPU_PATH = ROOT / "deploy" / "serve_config.yaml"

GRPC_PORT = 9000
HEALTH_PORT = 9001
HTTP_PORT = 8000
SERVICER_FUNCTIONS = [
    "genserve.v1.text_pb2_grpc.add_TextGenerationServicer_to_server",
    "genserve.v1.gan_pb2_grpc.add_ImageGanServicer_to_server",
    "genserve.v1.vae_pb2_grpc.add_VaeServicer_to_server",
    "genserve.v1.diffusion_pb2_grpc.add_DiffusionServicer_to_server",
    "genserve.v1.common_pb2_grpc.add_ServeStatusServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]
# Ray Serve's request path, set in every Ray process before Ray starts (services/serve.py; deploy/Dockerfile for GPU
# nodes): the proxy reaches replicas, and deployment handles reach each other, over gRPC instead of Ray actor calls,
# and a replica runs its router and our handlers on its own event loop instead of one thread each. Ray documents
# them as its throughput-optimised mode, less its direct ingress (a port per replica, not one gRPC port). With the
# access log off (serve_config's logging_config), a trivial RPC through the proxy went from 8.6 to 4.3 ms on 2 cores
# (docs/benchmarks.md, "Serve's per-request cost"). The replicas' gRPC messages may be as large as the proxy's
# (Ray's default for them is gRPC's 4 MiB): a larger request must reach our validation, which names the field, and a
# larger answer (many images) must reach the client, as they did over actor calls.
SERVE_ENV = {
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1),
}
# Ray on a small CPU node (`make serve`, services/serve.py), where the text replica's decode step needs every core
# and its threads spin at barriers, stalling whenever one of them is preempted (docs/benchmarks.md, "The path of a
# token"). Serve's controller reconciles every 0.1 s and each replica and handle exports its cached metrics every
# 0.1 s by default: on an idle 2-core stack that took 31% of a core (the controller 9%); these values bring it to 21%.
# Autoscaling still looks every second (metrics_interval_s), and a new replica starts at most half a second later.
# GPU nodes, with a core per replica, keep Ray's defaults.
LOCAL_SERVE_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}
# Ray's built-in resource of the head node: the health gateway must run where probes look (the head's pod).
HEAD_NODE_RESOURCE = "node:__internal_head__"


@dataclass(frozen=True)
class AppSpec:
    """How one application is deployed; `num_cpus`/`num_gpus` are per replica."""

    name: str
    deployment: str
    num_cpus: float
    num_gpus: float
    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float
    max_ongoing_requests: int
    max_queued_requests: int
    # the app's own `args` beside model_dir (text: services/text/settings.py; gan, vae: batcher.py's BatchArgs)
    settings: tuple[tuple[str, Any], ...] = ()
    route_prefix: str | None = None  # default /<name>; the HTTP API takes "/" (its paths start with /v1)
    loads_model: bool = True  # False: no model_dir arg (the HTTP API reaches the models through handles)

    def __post_init__(self) -> None:
        if not 0 < self.min_replicas <= self.max_replicas:
            raise ValueError(f"{self.name}: need 0 < min_replicas <= max_replicas")
        if self.target_ongoing_requests > self.max_ongoing_requests:
            raise ValueError(f"{self.name}: target_ongoing_requests must be <= max_ongoing_requests")


# Per-request cost sets the numbers: a text replica batches many streams (continuous batching), a diffusion
# request holds a slot in its replica's step loop for many U-Net steps, GAN/VAE calls are a single cheap forward pass.
# The text engine's settings per target (docs/deploy.md): on a 2-core CPU, the CPU runner's lookahead and the default
# KV budget; on an H100/H200, bf16, a KV cache of 35% of the GPU's memory (text replicas may share a GPU with each
# other and the image apps), large batches and CUDA graphs.
# torch_threads: Ray starts a replica with floor(num_cpus) threads, at least 1. Locally the text replica takes both
# cores (its decode step is the latency path; the image apps take one each); on GPU nodes each replica has its CPU.
LOCAL_TEXT_SETTINGS = (("dtype", "auto"), ("max_batched_tokens", 512), ("max_running", 64), ("max_lookahead", 8),
                       ("prefix_caching", True), ("torch_threads", 2))
GPU_TEXT_SETTINGS = (("dtype", "bfloat16"), ("kv_cache_fraction", 0.35), ("max_batched_tokens", 8192),
                     ("max_running", 256), ("max_lookahead", 1), ("cuda_graphs", True), ("prefix_caching", True),
                     ("torch_threads", 1))
# The GAN and VAE merge concurrent requests into one model call (services/common/batcher.py): a replica takes a
# batch's worth of one-image requests at once, and autoscaling adds a replica only when about a full batch waits.
LOCAL_BATCH_SETTINGS = (("max_batch_images", 32), ("batch_wait_s", 0.005), ("torch_threads", 1))
GPU_BATCH_SETTINGS = (("max_batch_images", 64), ("batch_wait_s", 0.002), ("torch_threads", 1))
# Diffusion runs one step loop per replica that all its requests join (services/diffusion/step_batcher.py): a
# replica takes many requests at once, bounded by U-Net rows per step (images × passes).
LOCAL_STEP_SETTINGS = (("max_step_rows", 48), ("batch_wait_s", 0.005), ("torch_threads", 1))
GPU_STEP_SETTINGS = (("max_step_rows", 192), ("batch_wait_s", 0.002), ("torch_threads", 1))
LOCAL_APPS = (
    AppSpec("text", "TextGeneration", 0.4, 0, 1, 2, 4, 16, 32, LOCAL_TEXT_SETTINGS),
    AppSpec("gan", "ImageGan", 0.1, 0, 1, 2, 32, 64, 128, LOCAL_BATCH_SETTINGS),
    AppSpec("vae", "Vae", 0.1, 0, 1, 2, 32, 64, 128, LOCAL_BATCH_SETTINGS),
    # 8 requests share a replica's loop; a burst past 2 x 8 + 8 is shed at once (tests/e2e/test_e2e_overload.py).
    AppSpec("diffusion", "Diffusion", 0.3, 0, 1, 2, 8, 8, 8, LOCAL_STEP_SETTINGS),
    # The HTTP API only forwards: it holds every open stream (far more than the apps behind it take), so the
    # apps behind it shed load first and their refusals reach the client as 429s.
    AppSpec("http", "OpenAIApi", 0.05, 0, 1, 2, 32, 256, 256, route_prefix="/", loads_model=False),
)
GPU_APPS = (
    AppSpec("text", "TextGeneration", 1, 0.4, 1, 4, 8, 256, 1024, GPU_TEXT_SETTINGS),
    AppSpec("gan", "ImageGan", 1, 0.1, 1, 4, 64, 128, 512, GPU_BATCH_SETTINGS),
    AppSpec("vae", "Vae", 1, 0.1, 1, 4, 64, 128, 512, GPU_BATCH_SETTINGS),
    AppSpec("diffusion", "Diffusion", 1, 0.3, 1, 4, 32, 64, 128, GPU_STEP_SETTINGS),
    AppSpec("http", "OpenAIApi", 1, 0, 1, 4, 64, 1024, 1024, route_prefix="/", loads_model=False),
)
HEALTH_NUM_CPUS = 0.01
HEALTH_MAX_ONGOING = 64


def _autoscaling(spec: AppSpec) -> dict[str, Any]:
    return {
        "min_replicas": spec.min_replicas,
        "max_replicas": spec.max_replicas,
        "target_ongoing_requests": spec.target_ongoing_requests,
        "upscale_delay_s": 2.0,
        "downscale_delay_s": 10.0,
        "metrics_interval_s": 1.0,
        "look_back_period_s": 2.0,
    }


def _graceful_shutdown() -> dict[str, float]:
    return {"graceful_shutdown_timeout_s": DRAIN_SECONDS, "graceful_shutdown_wait_loop_s": SHUTDOWN_WAIT_LOOP_S}


def _app(spec: AppSpec, model_dir: str | None) -> dict[str, Any]:
    actor_options: dict[str, Any] = {"num_cpus": spec.num_cpus}
    if spec.num_gpus:
        actor_options["num_gpus"] = spec.num_gpus
    return {
        "name": spec.name,
        "route_prefix": spec.route_prefix or f"/{spec.name}",
        "import_path": f"genserve.services.{spec.name}.app:build",
        "args": {"model_dir": model_dir, **dict(spec.settings)} if spec.loads_model else {},
        "deployments": [
            {
                "name": spec.deployment,
                "max_ongoing_requests": spec.max_ongoing_requests,
                "max_queued_requests": spec.max_queued_requests,
                "autoscaling_config": _autoscaling(spec),
                **_graceful_shutdown(),
                "ray_actor_options": actor_options,
            }
        ],
    }


def _health_app(host: str, port: int) -> dict[str, Any]:
    return {
        "name": "health",
        "route_prefix": "/health",
        "import_path": "genserve.services.common.health_app:build",
        "args": {"host": host, "port": port},
        "deployments": [
            {
                "name": "HealthGateway",
                "num_replicas": 1,
                # Watch streams stay open; past Serve's default of 5 they would queue the probes' Checks.
                "max_ongoing_requests": HEALTH_MAX_ONGOING,
                **_graceful_shutdown(),
                "ray_actor_options": {"num_cpus": HEALTH_NUM_CPUS, "resources": {HEAD_NODE_RESOURCE: 0.001}},
            }
        ],
    }


def serve_config(
    target: Literal["local", "gpu"],
    *,
    grpc_port: int = GRPC_PORT,
    health_port: int = HEALTH_PORT,
    http_port: int = HTTP_PORT,
    model_dirs: dict[str, str | None] | None = None,
) -> dict[str, Any]:
    """The serve config (ServeDeploySchema as a dict) for `target`."""
    apps = LOCAL_APPS if target == "local" else GPU_APPS
    host = "127.0.0.1" if target == "local" else "0.0.0.0"
    dirs = model_dirs or {}
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": host, "port": http_port},
        # Reflection lets grpcurl and similar tools list and call the services without the .proto files.
        "grpc_options": {"port": grpc_port, "grpc_servicer_functions": list(SERVICER_FUNCTIONS),
                         "enable_reflection": True},
        # Serve's access log writes a line per request from the proxy and the replica; our metrics count requests
        # (docs/metrics.md), and errors are still logged with their request id.
        "logging_config": {"encoding": "TEXT", "log_level": "INFO", "enable_access_log": False},
        "applications": [_app(spec, dirs.get(spec.name)) for spec in apps] + [_health_app(host, health_port)],
    }


def reserved_cpus(config: dict[str, Any]) -> float:
    """CPUs the config reserves with every app at its maximum replica count."""
    total = 0.0
    for app in config["applications"]:
        for dep in app["deployments"]:
            replicas = dep.get("autoscaling_config", {}).get("max_replicas", dep.get("num_replicas", 1))
            total += replicas * dep["ray_actor_options"]["num_cpus"]
    return total


HEADER = "# Written by `python -m genserve.services.common.deploy_config` ({what}); edit that module, not this file.\n"
# The text app's optional settings, off unless given: written as comments above its torch_threads (docs/deploy.md).
TEXT_ARGS_COMMENTS = (
    '# Exact speculative decoding, off unless given (docs/models.md, "Speculative decoding"):',
    "# speculative: {method: ngram, num_tokens: 4, ngram_min: 2, ngram_max: 4, max_batch: 8}",
    "# (or {method: draft, draft_model_dir: PATH, num_tokens: 4}: a smaller model with the same tokenizer drafts)",
    '# LoRA adapters, off unless given (docs/deploy.md, "LoRA adapters"): PEFT folders under `root` only, loaded',
    "# at start from `adapters` ({name: folder}) and at run time with an admin key (POST /v1/load_lora_adapter):",
    "# lora: {root: /models/lora, max_loras: 4, max_cpu_loras: 8, max_lora_rank: 16, adapters: {}}",
)


def _with_text_comments(text: str) -> str:
    """`text` (a dumped serve config) with TEXT_ARGS_COMMENTS above the text app's `torch_threads`."""
    lines = text.splitlines(keepends=True)
    at = next(i for i in range(lines.index("- name: text\n"), len(lines)) if lines[i].startswith("    torch_threads:"))
    return "".join(lines[:at] + [f"    {comment}\n" for comment in TEXT_ARGS_COMMENTS] + lines[at:])


def write(path: Path, config: dict[str, Any], what: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER.format(what=what) + _with_text_comments(yaml.safe_dump(config, sort_keys=False)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    write(LOCAL_PATH, serve_config("local"), "CPU, 2 cores")
    write(GPU_PATH, serve_config("gpu"), "GPU nodes")
    print(f"wrote {LOCAL_PATH.relative_to(ROOT)} and {GPU_PATH.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
