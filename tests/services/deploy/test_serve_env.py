"""Serve's request-path settings (deploy_config.SERVE_ENV) reach `make serve`'s Ray processes (the GPU image's:
test_dockerfile_pins.py), and the serve configs switch Serve's per-request access log off."""

from __future__ import annotations

import pytest

from genserve.services import serve
from genserve.services.common.deploy_config import LOCAL_SERVE_ENV, SERVE_ENV, serve_config


def test_serve_env_asks_for_grpc_between_ray_serve_components_and_no_extra_threads() -> None:
    assert SERVE_ENV == {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
                         "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                         "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
                         "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1)}


def test_replicas_take_gRPC_messages_as_large_as_the_proxy_does() -> None:
    """Ray's replica servers and channels default to gRPC's 4 MiB, its proxy to 2 GiB: a 9 MB fuzzed request got
    INTERNAL ("Received message larger than max") from the hop behind the proxy instead of our INVALID_ARGUMENT."""
    from ray.serve._private.constants import RAY_SERVE_GRPC_MAX_MESSAGE_SIZE

    assert int(SERVE_ENV["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"]) == RAY_SERVE_GRPC_MAX_MESSAGE_SIZE


def test_make_serve_sets_the_serve_env_before_ray_starts() -> None:
    assert SERVE_ENV.items() <= serve.RAY_ENV.items()


def test_make_serve_slows_serves_background_loops_to_what_its_settings_need() -> None:
    """The controller's loop and the metrics export run every 0.5 s and 1 s on a CPU node, not every 0.1 s, both
    inside the autoscaling period (metrics_interval_s) of every local app."""
    from ray.serve._private import constants

    assert LOCAL_SERVE_ENV.items() <= serve.RAY_ENV.items()
    assert hasattr(constants, "CONTROL_LOOP_INTERVAL_S") and hasattr(constants, "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS")
    loop_s = float(LOCAL_SERVE_ENV["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"])
    export_s = int(LOCAL_SERVE_ENV["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"]) / 1000
    for app in serve_config("local")["applications"]:
        for deployment in app["deployments"]:
            period = deployment.get("autoscaling_config", {}).get("metrics_interval_s")
            if period is not None:
                assert loop_s < period * 1.01 and export_s <= period, app["name"]


@pytest.mark.parametrize("target", ["local", "gpu"])
def test_serve_configs_switch_the_access_log_off(target: str) -> None:
    assert serve_config(target)["logging_config"]["enable_access_log"] is False
