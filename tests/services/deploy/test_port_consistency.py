"""One gRPC port everywhere: compose, Dockerfile, serve configs, KubeRay, the client's default, locust, Prometheus."""

from __future__ import annotations

import re
from pathlib import Path

import yaml


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _client_default_port(root: Path) -> int:
    """Read from the source: importing the client would let $GENSERVE_ADDRESS override the default under test."""
    source = (root / "services" / "client" / "sync.py").read_text()
    return _port(re.search(r'DEFAULT_ADDRESS = .*"([\w.]+:\d+)"\)?$', source, re.MULTILINE).group(1))


def _container_ports(compose: dict, service: str) -> set[int]:
    return {int(str(p).rsplit(":", 1)[-1]) for p in compose["services"][service].get("ports", [])}


def test_grpc_port_is_the_same_everywhere(
    root: Path, compose: dict, gpu_serve_config: dict, local_serve_config: dict, rayservice: dict
) -> None:
    grpc_port = gpu_serve_config["grpc_options"]["port"]
    head = compose["services"]["ray-head"]
    probe = head["healthcheck"]["test"][-1]
    locust_host = re.search(r"--host (\S+)", compose["services"]["locust"]["command"]).group(1)
    locustfile = (root / "tests" / "load" / "locustfile.py").read_text()
    ports = {
        "local serve config": local_serve_config["grpc_options"]["port"],
        "client default address": _client_default_port(root),
        "compose ray-head healthcheck": _port(re.search(r"insecure_channel\('([^']+)'\)", probe).group(1)),
        "compose locust --host": _port(locust_host),
        "locustfile DEFAULT_HOST": _port(re.search(r'DEFAULT_HOST = "([^"]+)"', locustfile).group(1)),
        "kuberay serve service": next(
            p["port"] for p in rayservice["spec"]["serveService"]["spec"]["ports"] if p["name"] == "grpc"
        ),
    }
    assert ports == dict.fromkeys(ports, grpc_port)
    assert grpc_port in _container_ports(compose, "ray-head")
    assert f"${{GENSERVE_GRPC_PORT:-{grpc_port}}}:{grpc_port}" in head["ports"]


def test_dockerfile_exposes_the_head_ports(root: Path, compose: dict, gpu_serve_config: dict) -> None:
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", (root / "deploy" / "Dockerfile").read_text(), re.M)
               for p in line.split()}
    assert _container_ports(compose, "ray-head") <= exposed
    assert gpu_serve_config["grpc_options"]["port"] in exposed


def _metrics_port(command: str) -> int:
    return int(re.search(r"--metrics-export-port=(\d+)", command).group(1))


def test_prometheus_scrapes_the_port_ray_exports_metrics_on(root: Path, compose: dict, rayservice: dict) -> None:
    prometheus = yaml.safe_load((root / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    head_target = jobs["ray-head"]["static_configs"][0]["targets"][0]
    assert head_target == f"ray-head:{_metrics_port(compose['services']['ray-head']['command'])}"
    worker_sd = jobs["ray-worker"]["dns_sd_configs"][0]
    assert worker_sd["names"] == ["ray-worker"]
    assert worker_sd["port"] == _metrics_port(compose["services"]["ray-worker"]["command"])
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert int(group["rayStartParams"]["metrics-export-port"]) == worker_sd["port"]


def test_http_port_is_the_same_everywhere(root: Path, compose: dict, gpu_serve_config: dict,
                                          rayservice: dict) -> None:
    http_port = gpu_serve_config["http_options"]["port"]
    service_ports = {p["name"]: p["port"] for p in rayservice["spec"]["serveService"]["spec"]["ports"]}
    assert service_ports["http"] == http_port
    assert http_port in _container_ports(compose, "ray-head")
    http_app = next(app for app in gpu_serve_config["applications"] if app["name"] == "http")
    assert http_app["route_prefix"] == "/"


def test_health_port_matches_the_health_app(gpu_serve_config: dict, rayservice: dict) -> None:
    service_ports = {p["name"]: p["port"] for p in rayservice["spec"]["serveService"]["spec"]["ports"]}
    assert service_ports["grpc-health"] == _health_port(gpu_serve_config)


def _health_port(serve_config: dict) -> int:
    return next(app for app in serve_config["applications"] if app["name"] == "health")["args"]["port"]


def test_load_runner_stack_never_collides_with_a_users_stack(root: Path, local_serve_config: dict) -> None:
    source = (root / "tests" / "load" / "run.py").read_text()
    stack_ports = re.search(r"^STACK_PORTS = \{(.+)\}$", source, re.MULTILINE).group(1)
    runner_ports = {int(port) for port in re.findall(r'"\w+": (\d+)', stack_ports)}
    default_ports = {
        local_serve_config["grpc_options"]["port"], _health_port(local_serve_config),
        local_serve_config["http_options"]["port"], 8080, 8265,
    }
    assert len(runner_ports) == 4 and not runner_ports & default_ports
