"""The one module that reaches into Ray's non-public API; everything else uses `ray` and `ray.serve` as documented.

Three things have no public form in Ray 2.60:
- starting a local Ray that binds 127.0.0.1 and exports metrics on a chosen port (`ray start` has both flags,
  `ray.init` only as underscore arguments);
- deploying a whole multi-application config from Python without the dashboard's REST API (what `serve run
  CONFIG` does internally), without waiting for every app to be RUNNING;
- the request id Ray Serve gave the current request (it prefixes the replica's log lines and comes back to the
  client in trailing metadata).
tests/services/common/test_ray_adapter.py checks that each of these still exists with the arguments used here, so a
Ray upgrade that moves one fails that test instead of a deployment.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PRIVATE_API = {
    # (module, attribute): the parameter names this module passes
    ("ray", "init"): ("_metrics_export_port", "_node_ip_address"),
    ("ray.serve._private.api", "serve_start"): ("http_options", "grpc_options", "proxy_location"),
    ("ray.serve._private.client", "ServeControllerClient.deploy_apps"): ("config", "_blocking"),
    ("ray.serve.context", "_get_serve_request_context"): (),
}


def init_local_ray(*, metrics_port: int, num_cpus: float | None, include_dashboard: bool, dashboard_port: int,
                   log_to_driver: bool, namespace: str, object_store_memory: int) -> None:
    """A fresh single-node Ray bound to 127.0.0.1 (never joining another cluster), exporting Prometheus metrics on
    `metrics_port`."""
    import ray

    with _outside_the_checkout():
        ray.init(
            address="local", num_cpus=num_cpus, include_dashboard=include_dashboard, dashboard_port=dashboard_port,
            log_to_driver=log_to_driver, namespace=namespace, object_store_memory=object_store_memory,
            _metrics_export_port=metrics_port, _node_ip_address="127.0.0.1",
        )


@contextlib.contextmanager
def _outside_the_checkout() -> Iterator[None]:
    """Ray puts the driver's working directory first on every worker's sys.path. From a checkout's root that would make
    its folders (kernels/, services/) top-level packages in the replicas, shadowing installed distributions of those
    names (Hugging Face's `kernels`, which transformers imports); genserve itself imports as `genserve.*`. So the
    driver joins Ray from an empty folder of its own."""
    empty = Path(tempfile.gettempdir()) / "genserve-ray-driver"
    empty.mkdir(exist_ok=True)
    before = os.getcwd()
    os.chdir(empty)
    try:
        yield
    finally:
        os.chdir(before)


def deploy_config(config: dict[str, Any]) -> None:
    """Start Serve with the config's proxy options and submit all its applications (ServeDeploySchema as a dict),
    returning at once; the caller polls `serve.status()`."""
    from ray.serve._private.api import serve_start
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    client = serve_start(
        http_options=schema.http_options.model_dump(), proxy_location=schema.proxy_location,
        grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
    )
    client.deploy_apps(schema, _blocking=False)


def serve_request_id() -> str:
    """The id Ray Serve gave the request being handled ("" outside a request)."""
    from ray.serve.context import _get_serve_request_context

    return _get_serve_request_context().request_id or ""
