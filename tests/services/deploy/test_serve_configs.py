"""deploy/serve_config*.yaml: Ray Serve accepts them, every app autoscales and sheds load, resources fit the target."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray.serve.schema import ServeDeploySchema

APPS = {"text", "gan", "vae", "diffusion"}
AUTOSCALING_KEYS = ("min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s")


def _model_deployments(config: dict) -> dict[str, dict]:
    return {app["name"]: dep for app in config["applications"] if app["name"] in APPS for dep in app["deployments"]}


@pytest.fixture(params=["gpu", "local"])
def serve_config(request, gpu_serve_config: dict, local_serve_config: dict) -> dict:
    return gpu_serve_config if request.param == "gpu" else local_serve_config


def test_ray_serve_accepts_the_config(serve_config: dict) -> None:
    ServeDeploySchema.model_validate(serve_config)


def test_config_has_the_four_applications(serve_config: dict) -> None:
    assert set(_model_deployments(serve_config)) == APPS


def test_every_application_autoscales(serve_config: dict) -> None:
    for name, dep in _model_deployments(serve_config).items():
        scaling = dep["autoscaling_config"]
        missing = [key for key in AUTOSCALING_KEYS if key not in scaling]
        assert not missing, f"{name}: autoscaling_config lacks {missing}"
        assert 0 <= scaling["min_replicas"] <= scaling["max_replicas"], name
        assert scaling["max_replicas"] > scaling["min_replicas"], f"{name} cannot scale up"
        assert scaling["upscale_delay_s"] >= 0 and scaling["downscale_delay_s"] >= scaling["upscale_delay_s"], name


def test_every_application_bounds_its_queue(serve_config: dict) -> None:
    """Past max_ongoing_requests per replica requests queue; past max_queued_requests they get RESOURCE_EXHAUSTED."""
    for name, dep in _model_deployments(serve_config).items():
        assert dep["max_ongoing_requests"] >= dep["autoscaling_config"]["target_ongoing_requests"] > 0, name
        assert dep["max_queued_requests"] >= 1, f"{name}: an unbounded queue (-1) never sheds load"


def test_gpu_replicas_take_a_fraction_of_a_gpu(gpu_serve_config: dict) -> None:
    for name, dep in _model_deployments(gpu_serve_config).items():
        assert 0 < dep["ray_actor_options"]["num_gpus"] <= 1, name


def test_one_replica_of_every_app_fits_one_gpu(gpu_serve_config: dict) -> None:
    """The minimum deployment must start on a single-GPU node (docs/deploy.md, GPU fractions)."""
    deployments = _model_deployments(gpu_serve_config).values()
    assert sum(d["autoscaling_config"]["min_replicas"] * d["ray_actor_options"]["num_gpus"] for d in deployments) <= 1


def test_local_config_asks_for_no_gpu(local_serve_config: dict) -> None:
    """A replica that asks for a GPU on a CPU-only machine stays DEPLOYING forever."""
    for app in local_serve_config["applications"]:
        for dep in app["deployments"]:
            assert not dep.get("ray_actor_options", {}).get("num_gpus"), app["name"]


def test_deploy_docs_table_is_the_gpu_config(root: Path, gpu_serve_config: dict) -> None:
    """docs/deploy.md repeats the GPU numbers for readers; they must not drift from the config."""
    rows = {}
    for line in (root / "docs" / "deploy.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0] in APPS:
            rows[cells[0]] = cells[1:]
    assert set(rows) == APPS
    for name, dep in _model_deployments(gpu_serve_config).items():
        scaling, actor = dep["autoscaling_config"], dep["ray_actor_options"]
        expected = [
            f"{actor['num_gpus']:g}",
            f"{actor['num_cpus']:g}",
            f"{scaling['min_replicas']}..{scaling['max_replicas']}",
            f"{scaling['target_ongoing_requests']:g}",
            str(dep["max_ongoing_requests"]),
            str(dep["max_queued_requests"]),
        ]
        assert rows[name] == expected, name


def test_every_model_app_sets_its_replicas_threads(local_serve_config: dict, gpu_serve_config: dict) -> None:
    """Ray would start a replica on floor(num_cpus) threads (1 for every fractional local app); the configs say."""
    for config, expected in ((local_serve_config, {"text": 2, "gan": 1, "vae": 1, "diffusion": 1}),
                             (gpu_serve_config, {"text": 1, "gan": 1, "vae": 1, "diffusion": 1})):
        apps = {app["name"]: app for app in config["applications"]}
        assert {name: apps[name]["args"]["torch_threads"] for name in expected} == expected
        assert "torch_threads" not in apps["http"]["args"]  # it loads no model


def test_use_torch_threads_sets_torch_and_the_c_kernels_count() -> None:
    import torch

    from genserve.kernels import _cpu_library
    from genserve.services.common.device import use_torch_threads

    before = torch.get_num_threads()
    try:
        use_torch_threads(1)
        assert torch.get_num_threads() == 1 and _cpu_library.threads() == 1
        use_torch_threads(None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
