"""The local Ray Serve stack, started once per test run: `python -m services.serve` on its own ports.

Ports default to 9100 (gRPC), 9101 (health), 8100 (HTTP) and 8102 (metrics), away from `make serve` (9000) and
the load-test stack (9200); GENSERVE_E2E_GRPC_PORT moves the whole block. The stack serves the committed demo
weights unless GENSERVE_TEXT_MODEL / GENSERVE_GAN_MODEL / ... point elsewhere (the variables reach the replicas).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.client import Client
from services.common.builder import model_dir_env
from services.serve import READY_LINE

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Stack:
    grpc_port: int
    health_port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def health_address(self) -> str:
        return f"127.0.0.1:{self.health_port}"


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


def e2e_base_port() -> int:
    return int(os.environ.get("GENSERVE_E2E_GRPC_PORT", "9100"))


@contextlib.contextmanager
def serve_stack(base: int, log: Path, extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None
                ) -> Iterator[Stack]:
    """`python -m services.serve` on the port block at ``base``, until the context exits."""
    ports = {"grpc": base, "health": base + 1, "http": base - 1000, "metrics": base - 998}
    busy = [f"{name} {port}" for name, port in ports.items() if not _port_free(port)]
    if busy:
        pytest.fail(f"ports in use ({', '.join(busy)}); set GENSERVE_E2E_GRPC_PORT to another block")
    command = [
        sys.executable, "-m", "services.serve", "--grpc-port", str(ports["grpc"]),
        "--health-port", str(ports["health"]), "--http-port", str(ports["http"]),
        "--metrics-port", str(ports["metrics"]), "--timeout", str(START_TIMEOUT_S - 20), *extra_args,
    ]
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   env=None if env is None else {**os.environ, **env})
    try:
        _wait_ready(process, log)
        yield Stack(ports["grpc"], ports["health"], log)
    finally:
        _stop(process)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    missing = _missing_weights()
    if missing:
        pytest.fail(f"no weights to serve: {', '.join(missing)}")
    with serve_stack(e2e_base_port(), tmp_path_factory.mktemp("stack") / "serve.log") as running:
        yield running


@pytest.fixture(scope="session")
def client(stack: Stack) -> Iterator[Client]:
    with Client(stack.address, timeout=60) as c:
        yield c
