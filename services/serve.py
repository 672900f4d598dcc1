"""`make serve`: start Ray on 127.0.0.1, deploy deploy/serve_config.local.yaml, wait until every app is RUNNING,
print how to call it, and on Ctrl-C or SIGTERM drain, then shut everything down.

Draining (services/common/drain.py): new calls get UNAVAILABLE (HTTP 503) and health says NOT_SERVING, the calls
in flight run on for up to --drain-seconds (GENSERVE_DRAIN_SECONDS, 30), the rest end with CANCELLED; then Serve and
Ray stop and the process exits 0. A second Ctrl-C or SIGTERM skips what is left of the drain.

Ports are flags (or env vars) so that several stacks can share a machine:
  --grpc-port (GENSERVE_GRPC_PORT, 9000)    the Serve gRPC proxy; clients send the `application` metadata
  --health-port (GENSERVE_HEALTH_PORT, 9001) grpc.health.v1.Health/Check for clients without metadata
  --http-port (GENSERVE_HTTP_PORT, 8000)    the Serve HTTP proxy: the OpenAI-compatible API under /v1
  --metrics-port (GENSERVE_METRICS_PORT, 8080) Ray's Prometheus endpoint, with the genserve_* metrics
Ray's own ports (GCS, raylet, object manager) are picked free at start.
GENSERVE_TLS_CERT + GENSERVE_TLS_KEY (+ GENSERVE_TLS_CLIENT_CA): gRPC and HTTP over TLS (services/common/tls_front.py).

Who may call (docs/security.md): with GENSERVE_API_KEYS / GENSERVE_API_KEYS_FILE every call needs one of the keys;
without keys only callers on this host are served, unless --insecure (GENSERVE_INSECURE=1). The replicas read the
same variables: they inherit this process's environment.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from genserve.services.common import drain, ray_adapter, tls_front
from genserve.services.common.auth import INSECURE_ENV, KEYS_FILE_ENV, Access, insecure
from genserve.services.common.deploy_config import (
    GRPC_PORT,
    HEALTH_PORT,
    HTTP_PORT,
    LOCAL_PATH,
    LOCAL_SERVE_ENV,
    SERVE_ENV,
)
from genserve.services.text import default_model

# Ray must bind 127.0.0.1, must not switch on token auth (a second driver could not connect), and must not phone
# home (no network here); Serve's request path as on GPU nodes (deploy_config.SERVE_ENV), and less of Serve's
# background work on a CPU node's few cores (deploy_config.LOCAL_SERVE_ENV).
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    **SERVE_ENV,
    **LOCAL_SERVE_ENV,
}
METRICS_PORT = 8080
CUT_GRACE_S = 5.0  # past the drain time: for the replicas to end their calls and the statuses to reach the clients
READY_LINE = "genserve: ready"


class Stop(Exception):
    """Raised by the signal handlers to leave the wait loop and shut down."""


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=LOCAL_PATH, help="serve config YAML (default: the CPU one)")
    parser.add_argument("--grpc-port", type=int, default=_env_int("GENSERVE_GRPC_PORT", GRPC_PORT),
                        help="the Serve gRPC proxy (default $GENSERVE_GRPC_PORT or 9000)")
    parser.add_argument("--health-port", type=int, default=_env_int("GENSERVE_HEALTH_PORT", HEALTH_PORT),
                        help="Health/Check without metadata (default $GENSERVE_HEALTH_PORT or 9001)")
    parser.add_argument("--http-port", type=int, default=_env_int("GENSERVE_HTTP_PORT", HTTP_PORT),
                        help="Serve's HTTP proxy: the OpenAI-compatible API (default $GENSERVE_HTTP_PORT or 8000)")
    parser.add_argument("--metrics-port", type=int, default=_env_int("GENSERVE_METRICS_PORT", METRICS_PORT),
                        help="Prometheus metrics (default $GENSERVE_METRICS_PORT or 8080)")
    parser.add_argument("--insecure", action="store_true", default=insecure(),
                        help="with no API keys configured, serve callers from OTHER hosts too (default: only this "
                             "host; $GENSERVE_INSECURE=1 does the same)")
    parser.add_argument("--dashboard", action="store_true", help="also start the Ray dashboard (about 1 GB)")
    parser.add_argument("--dashboard-port", type=int, default=_env_int("GENSERVE_DASHBOARD_PORT", 8265))
    parser.add_argument("--num-cpus", type=float, default=None, help="CPUs Ray may schedule (default: all)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for every app to be RUNNING")
    parser.add_argument("--drain-seconds", type=float, default=drain.drain_seconds(),
                        help="on SIGTERM, how long calls in flight may run on (default $GENSERVE_DRAIN_SECONDS or "
                             f"{drain.DRAIN_SECONDS:.0f}); also how long a replica that scales down waits for them")
    parser.add_argument("--verbose", action="store_true", help="print the replicas' logs here")
    parser.add_argument("--text-model", metavar="PATH", default=None,
                        help="a HF checkpoint directory or a GGUF file for the text app (default: "
                             "$GENSERVE_TEXT_MODEL, else the fetched default model, else the demo weights)")
    for app in ("gan", "vae", "diffusion"):
        parser.add_argument(
            f"--{app}-model", metavar="DIR", default=None,
            help=f"checkpoint directory for the {app} app (default: $GENSERVE_{app.upper()}_MODEL or demo weights)"
            + ("; a diffusers Stable Diffusion folder also serves its vae/ as the vae app" if app == "diffusion"
               else ""),
        )


def load_config(args: argparse.Namespace) -> dict[str, Any]:
    """The config file with this run's ports and model directories put in."""
    from genserve.services.common.builder import (  # imports ray: only after RAY_ENV is set
        model_dir_env,
        pipeline_vae_dir,
    )

    config = yaml.safe_load(args.config.read_text())
    config["grpc_options"]["port"] = args.grpc_port
    config["http_options"]["port"] = args.http_port
    for app in config["applications"]:
        for deployment in app["deployments"]:
            deployment["graceful_shutdown_timeout_s"] = args.drain_seconds
        if app["name"] == "health":
            app["args"]["port"] = args.health_port
        model_dir = getattr(args, f"{app['name']}_model", None)
        if app["name"] == "text":
            model_dir = default_model.resolve(model_dir or app["args"].get("model_dir"))
        if model_dir:
            app["args"]["model_dir"] = str(Path(model_dir).resolve())
    # A Stable Diffusion folder's vae/ serves as `vae` unless --vae-model or GENSERVE_VAE_MODEL names another.
    vae_dir = pipeline_vae_dir(getattr(args, "diffusion_model", None))
    if vae_dir and not getattr(args, "vae_model", None) and not os.environ.get(model_dir_env("vae")):
        for app in config["applications"]:
            if app["name"] == "vae" and not app["args"].get("model_dir"):
                app["args"]["model_dir"] = str(Path(vae_dir).resolve())
    return config


def applications_failed(messages: dict[str, str]) -> RuntimeError:
    """The error `run` prints for apps that failed (name -> why), before or during the deploy."""
    return RuntimeError("applications failed: " + "; ".join(f"{n}: {m}" for n, m in messages.items()))


def args_errors(config: dict[str, Any]) -> dict[str, str]:
    """App name -> why its builder (`import_path`) refuses its `args`: the validation Serve's build task runs, done
    here first, since Serve retries a failed build three times, each in a new worker that imports the app again."""
    errors = {}
    for app in config["applications"]:
        module, _, builder = app["import_path"].partition(":")
        try:
            getattr(importlib.import_module(module), builder)(app.get("args") or {})
        except ValueError as exc:  # pydantic's ValidationError is one, naming every field
            errors[app["name"]] = str(exc)
    return errors


def start(args: argparse.Namespace, config: dict[str, Any]) -> Any:
    """Start a fresh local Ray (never join another stack's), create the drain board and submit the config once every
    app's args are valid; returns the board. The args are checked while Ray starts (importing the apps takes seconds
    of its own)."""
    with ThreadPoolExecutor(1) as pool:
        checked = pool.submit(args_errors, config)
        ray_adapter.init_local_ray(
            metrics_port=args.metrics_port, num_cpus=args.num_cpus, include_dashboard=args.dashboard,
            dashboard_port=args.dashboard_port, log_to_driver=args.verbose, namespace="genserve",
            object_store_memory=512 * 2**20,
        )
        errors = checked.result()
    if errors:
        raise applications_failed(errors)
    board = drain.create_board()
    ray_adapter.deploy_config(config)
    return board


def wait_ready(names: list[str], timeout: float) -> None:
    """Block until every application in `names` is RUNNING; raise RuntimeError when one fails or time runs out."""
    from ray import serve

    from genserve.services.common.health_app import label

    deadline = time.monotonic() + timeout
    statuses: dict[str, str] = {}
    while time.monotonic() < deadline:
        apps = serve.status().applications
        statuses = {name: label(apps[name].status) if name in apps else "NOT_STARTED" for name in names}
        failed = {n: apps[n].message for n in names if statuses[n] in ("DEPLOY_FAILED", "UNHEALTHY")}
        if failed:
            raise applications_failed(failed)
        if all(s == "RUNNING" for s in statuses.values()):
            return
        time.sleep(0.5)
    raise RuntimeError(f"not RUNNING after {timeout:.0f} s: {statuses}")


def drain_calls(board: Any, seconds: float) -> None:
    """Stop taking calls, wait until no replica has a call in flight or `seconds` pass; past that, the replicas end
    their calls (CANCELLED) and report them gone."""
    import ray

    started = time.monotonic()
    ray.get(board.start.remote(seconds))
    print(f"genserve: draining: no new calls; calls in flight may run for {seconds:.0f} s "
          "(Ctrl-C again to stop now)", flush=True)
    while (pending := ray.get(board.pending.remote())) and time.monotonic() - started < seconds:
        time.sleep(drain.POLL_S)
    if pending:
        print(f"genserve: drain time over: ending {pending} calls", flush=True)
        cut_by = time.monotonic() + CUT_GRACE_S
        while ray.get(board.pending.remote()) and time.monotonic() < cut_by:
            time.sleep(drain.POLL_S)
    ray.get(board.stop.remote())
    print(f"genserve: drained in {time.monotonic() - started:.1f} s", flush=True)


def shutdown() -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():  # failed before start(): serve.shutdown() would start a Ray just to stop it
        return
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def config_text_model(config: dict[str, Any]) -> str:
    text = next((app for app in config["applications"] if app["name"] == "text"), None)
    return (text["args"].get("model_dir") if text else None) or "the committed demo model"


def usage(args: argparse.Namespace, config: dict[str, Any], front: tls_front.Front | None = None) -> str:
    front = front or tls_front.Front()
    address = f"127.0.0.1:{args.grpc_port}"
    flag = ("" if args.grpc_port == GRPC_PORT else f" --address {address}") + front.client_flags()
    scheme = "https" if front.active else "http"
    return "\n".join([
        f"{READY_LINE}: gRPC on {address} (metadata application=text|gan|vae|diffusion), "
        f"the OpenAI-compatible API on {scheme}://127.0.0.1:{args.http_port}/v1, "
        f"health without metadata on 127.0.0.1:{args.health_port}, metrics on 127.0.0.1:{args.metrics_port}",
        f"  text model: {config_text_model(config)}",
        "  in another shell:",
        f"    genserve{flag} chat \"What is the capital of France?\"",
        f"    genserve{flag} chat",
        f"    genserve{flag} text \"The with statement\" --stream",
        f"    genserve{flag} gan -n 16 -o samples/",
        f"    genserve{flag} diffuse \"a large blue square at the bottom right\" -o square.png",
        f"    genserve{flag} vae reconstruct square.png -o recon.png",
        f"    genserve{flag} status",
        f"    curl{front.client_flags(curl=True)} {scheme}://127.0.0.1:{args.http_port}/v1/chat/completions "
        "-H 'content-type: application/json' "
        "-d '{\"model\": \"text\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'",
        *([front.summary()] if front.active else []),
        "  Ctrl-C stops everything.",
    ])


def access(args: argparse.Namespace) -> Access:
    """The key set and peer rule the replicas will apply (they read the same environment), checked here first so a
    bad key file stops the start-up at once. A relative key-file path is made absolute: replicas run elsewhere."""
    if args.insecure:
        os.environ[INSECURE_ENV] = "1"
    if os.environ.get(KEYS_FILE_ENV):
        os.environ[KEYS_FILE_ENV] = str(Path(os.environ[KEYS_FILE_ENV]).resolve())
    return Access.from_env()


def announce(rule: Access) -> None:
    """Say who may call; --insecure without keys says it loudly, on stderr too."""
    print(f"genserve: {rule.describe()}", flush=True)
    if rule.digests:
        print("  clients send `authorization: Bearer <key>`: genserve --api-key KEY (or $GENSERVE_API_KEY), the openai "
              "SDK's api_key=, curl -H 'authorization: Bearer KEY'", flush=True)
    if rule.insecure and not rule.digests:
        banner = "!" * 100
        print(f"{banner}\ngenserve: --insecure: NO API KEYS. Anyone who can reach the gRPC port (Ray binds it on "
              f"every interface) can use every model.\n{banner}", file=sys.stderr, flush=True)


def taken_ports(args: argparse.Namespace) -> list[str]:
    """The public ports that something already holds (another `make serve`, most often), each as 'PORT (what, --flag
    or ENV)'. Ray's gRPC and HTTP proxies bind every interface, so a bind on 127.0.0.1 fails exactly when they could
    not start."""
    wanted = [(args.grpc_port, "gRPC", "--grpc-port", "GENSERVE_GRPC_PORT"),
              (args.http_port, "HTTP", "--http-port", "GENSERVE_HTTP_PORT"),
              (args.health_port, "health", "--health-port", "GENSERVE_HEALTH_PORT"),
              (args.metrics_port, "metrics", "--metrics-port", "GENSERVE_METRICS_PORT")]
    taken = []
    for port, what, flag, env in wanted:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # As the servers bind: a port whose old connections linger in TIME_WAIT is free, a listening one is not.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                taken.append(f"{port} ({what}: {flag} or {env})")
    return taken


def _raise_stop(signum: int, frame: object) -> None:
    raise Stop(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    # Before the first `import ray`: Ray reads some of these once, when its constants module loads.
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    taken = taken_ports(args)
    if taken:
        print(f"genserve: port {', '.join(taken)} already in use on 127.0.0.1: is another `make serve` running? Stop "
              "it, or give this one other ports.", file=sys.stderr, flush=True)
        return 1
    try:
        rule = access(args)
    except (OSError, ValueError) as exc:
        print(f"genserve: API keys: {exc}", file=sys.stderr, flush=True)
        return 1
    announce(rule)
    config = load_config(args)
    started, board = time.monotonic(), None
    front = tls_front.Front()
    try:
        front = tls_front.start(config)  # GENSERVE_TLS_*: Caddy takes the public gRPC port, Serve moves behind it
        board = start(args, config)
        # After ray.init, which installs its own SIGTERM handler in the driver.
        signal.signal(signal.SIGINT, _raise_stop)
        signal.signal(signal.SIGTERM, _raise_stop)
        wait_ready([app["name"] for app in config["applications"]], args.timeout)
        print(usage(args, config, front), flush=True)
        print(f"  (ready in {time.monotonic() - started:.1f} s)", flush=True)
        while True:
            time.sleep(3600)
    except Stop as stop:
        print(f"genserve: {stop}, shutting down", flush=True)
        try:
            drain_calls(board, args.drain_seconds)
        except Stop:
            print("genserve: stopping now", flush=True)
        return 0
    except RuntimeError as exc:
        print(f"genserve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        shutdown()
        front.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="genserve serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
