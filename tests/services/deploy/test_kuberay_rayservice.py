"""deploy/kuberay/rayservice.yaml: the same serve config as deploy/serve_config.yaml, GPU workers that autoscale."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml


def _render_module(root: Path):
    spec = importlib.util.spec_from_file_location("kuberay_render", root / "deploy" / "kuberay" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_config_v2_is_the_gpu_serve_config(rayservice: dict, gpu_serve_config: dict) -> None:
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"]) == gpu_serve_config


def test_committed_manifest_is_fresh(root: Path) -> None:
    """Fails when deploy/serve_config.yaml changed and `python deploy/kuberay/render.py` was not rerun."""
    committed = (root / "deploy" / "kuberay" / "rayservice.yaml").read_text()
    assert _render_module(root).render() == committed


def test_rayservice_kind_and_ray_version_match_the_pins(rayservice: dict, pyproject: dict) -> None:
    assert rayservice["apiVersion"] == "ray.io/v1"
    assert rayservice["kind"] == "RayService"
    ray_pin = next(d for d in pyproject["project"]["optional-dependencies"]["server"] if d.startswith("ray["))
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == ray_pin.split("==")[1]


def test_gpu_worker_group_autoscales_nodes(rayservice: dict) -> None:
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    gpu_groups = [
        g for g in cluster["workerGroupSpecs"]
        if any("nvidia.com/gpu" in c["resources"]["limits"] for c in g["template"]["spec"]["containers"])
    ]
    assert gpu_groups
    for group in gpu_groups:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert group["maxReplicas"] > group["minReplicas"]


def test_head_places_no_gpu_replicas_and_exposes_the_grpc_port(rayservice: dict, gpu_serve_config: dict) -> None:
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    ports = {p["containerPort"] for c in head["template"]["spec"]["containers"] for p in c["ports"]}
    assert gpu_serve_config["grpc_options"]["port"] in ports
    service_ports = {p["port"] for p in rayservice["spec"]["serveService"]["spec"]["ports"]}
    assert gpu_serve_config["grpc_options"]["port"] in service_ports


def test_every_pod_mounts_the_weights_claim(rayservice: dict, root: Path) -> None:
    claim = yaml.safe_load((root / "deploy" / "kuberay" / "weights-pvc.yaml").read_text())["metadata"]["name"]
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        spec = group["template"]["spec"]
        claims = {v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
        assert claim in claims
        assert all(any(m["mountPath"] == "/weights" for m in c["volumeMounts"]) for c in spec["containers"])


def test_kuberay_image_is_the_compose_image(rayservice: dict, compose: dict) -> None:
    default_image = re.fullmatch(r"\$\{GENSERVE_IMAGE:-(.+)\}", compose["services"]["ray-head"]["image"]).group(1)
    cluster = rayservice["spec"]["rayClusterConfig"]
    images = {c["image"] for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
              for c in g["template"]["spec"]["containers"]}
    assert images == {default_image}


def test_every_pod_outlives_its_replicas_drain(rayservice: dict, gpu_serve_config: dict) -> None:
    """A stopping pod gives its replicas their graceful_shutdown_timeout_s, and a margin, before it is killed."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    deployments = [d for app in gpu_serve_config["applications"] for d in app["deployments"]]
    drain = max(d["graceful_shutdown_timeout_s"] for d in deployments)
    assert all(pod["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + 15 for pod in pods)
