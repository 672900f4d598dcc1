"""Both serve configs come from services/common/deploy_config.py, are valid for Ray Serve, and fit their hosts."""

from __future__ import annotations

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from genserve.services.common import deploy_config
from genserve.services.common.deploy_config import GPU_PATH, LOCAL_PATH, reserved_cpus, serve_config
from genserve.services.common.drain import DRAIN_SECONDS, SHUTDOWN_WAIT_LOOP_S

MODEL_APPS = {"text", "gan", "vae", "diffusion"}


def model_deployments(config: dict) -> dict[str, dict]:
    return {app["name"]: app["deployments"][0] for app in config["applications"] if app["name"] in MODEL_APPS}


def test_committed_files_are_what_the_module_writes() -> None:
    """deploy/serve_config.yaml's GPU numbers may be tuned by hand (H7); the local file must match exactly."""
    assert yaml.safe_load(LOCAL_PATH.read_text()) == serve_config("local")
    gpu = yaml.safe_load(GPU_PATH.read_text())
    assert [a["name"] for a in gpu["applications"]] == [a["name"] for a in serve_config("gpu")["applications"]]


def test_configs_validate_as_serve_deploy_schemas() -> None:
    for target in ("local", "gpu"):
        ServeDeploySchema.model_validate(serve_config(target))


def test_local_config_fits_two_cores_without_gpus() -> None:
    config = serve_config("local")
    assert reserved_cpus(config) <= 2.0
    for app in config["applications"]:
        assert "num_gpus" not in app["deployments"][0]["ray_actor_options"], app["name"]


def test_gpu_config_gives_every_model_a_gpu_fraction() -> None:
    for name, dep in model_deployments(serve_config("gpu")).items():
        assert 0 < dep["ray_actor_options"]["num_gpus"] <= 1, name


def test_every_app_autoscales_and_bounds_its_queue() -> None:
    for target in ("local", "gpu"):
        for name, dep in model_deployments(serve_config(target)).items():
            scaling = dep["autoscaling_config"]
            assert 1 <= scaling["min_replicas"] < scaling["max_replicas"], (target, name)
            assert 0 < scaling["target_ongoing_requests"] <= dep["max_ongoing_requests"], (target, name)
            assert dep["max_queued_requests"] > 0, (target, name)


def test_ports_and_model_dirs_are_parameters() -> None:
    config = serve_config("local", grpc_port=9100, health_port=9101, model_dirs={"text": "/m/text"})
    assert config["grpc_options"]["port"] == 9100
    apps = {app["name"]: app for app in config["applications"]}
    assert apps["health"]["args"]["port"] == 9101
    assert apps["text"]["args"]["model_dir"] == "/m/text" and apps["gan"]["args"]["model_dir"] is None
    assert set(deploy_config.SERVICER_FUNCTIONS) == set(config["grpc_options"]["grpc_servicer_functions"])


@pytest.mark.parametrize("target", ["local", "gpu"])
def test_every_deployment_drains_for_the_drain_time(target: str) -> None:
    deployments = [d for app in serve_config(target)["applications"] for d in app["deployments"]]
    assert {d["graceful_shutdown_timeout_s"] for d in deployments} == {DRAIN_SECONDS}
    assert {d["graceful_shutdown_wait_loop_s"] for d in deployments} == {SHUTDOWN_WAIT_LOOP_S}
