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


def test_committed_manifests_are_fresh(root: Path) -> None:
    """Fails when deploy/serve_config.yaml or tls_front changed and `python deploy/kuberay/render.py` was not rerun."""
    render = _render_module(root)
    folder = root / "deploy" / "kuberay"
    assert render.render() == (folder / "rayservice.yaml").read_text()
    assert render.render(tls=True) == (folder / "rayservice.tls.yaml").read_text()
    assert render.render_tls_front() == (folder / "tls-front.yaml").read_text()


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


def _head_containers(manifest: dict) -> list[dict]:
    return manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]


def test_tls_manifest_is_the_plain_one_plus_a_caddy_sidecar(rayservice: dict, rayservice_tls: dict) -> None:
    ray_head, sidecar = _head_containers(rayservice_tls)
    assert ray_head == _head_containers(rayservice)[0]  # KubeRay takes the first container for Ray
    assert sidecar["name"] == "tls-front" and sidecar["image"].startswith("caddy:")
    assert rayservice_tls["spec"]["serveConfigV2"] == rayservice["spec"]["serveConfigV2"]
    assert rayservice_tls["spec"]["rayClusterConfig"]["workerGroupSpecs"] == \
        rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    plain_ports = rayservice["spec"]["serveService"]["spec"]["ports"]
    tls_ports = rayservice_tls["spec"]["serveService"]["spec"]["ports"]
    assert tls_ports[:len(plain_ports)] == plain_ports
    added = {p["name"]: p["port"] for p in tls_ports[len(plain_ports):]}
    assert added == {p["name"]: p["containerPort"] for p in sidecar["ports"]} == {"grpc-tls": 9443, "https": 8443}


def test_tls_sidecar_mounts_the_config_map_and_the_secret(rayservice_tls: dict, tls_front_config_map: dict,
                                                         root: Path) -> None:
    spec = rayservice_tls["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    sidecar = _head_containers(rayservice_tls)[1]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in sidecar["volumeMounts"]}
    assert mounts["/etc/genserve-tls"]["configMap"]["name"] == tls_front_config_map["metadata"]["name"]
    assert mounts["/certs"]["secret"]["secretName"] == "genserve-tls"
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in sidecar["env"]}
    assert sidecar["args"][-1] == "/etc/genserve-tls/$(GENSERVE_TLS_FRONT)"
    assert env["GENSERVE_TLS_FRONT"] in tls_front_config_map["data"]
    # The head's own proxies at the pod's IP, not 127.0.0.1, which the no-keys peer rule would take for a local caller.
    assert env["GENSERVE_TLS_UPSTREAM"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    for name, text in tls_front_config_map["data"].items():
        assert text == (root / "deploy" / "tls" / name).read_text(), name


def test_tls_sidecar_runs_the_compose_caddy_image(rayservice_tls: dict, compose: dict) -> None:
    default = re.fullmatch(r"\$\{GENSERVE_CADDY_IMAGE:-(.+)\}", compose["services"]["tls-front"]["image"]).group(1)
    assert _head_containers(rayservice_tls)[1]["image"] == default
