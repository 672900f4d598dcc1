"""Ray's non-public API is used in services/common/ray_adapter.py only, and what it uses still exists."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from genserve.services.common import ray_adapter

ROOT = Path(__file__).resolve().parents[3]
# `ray.<anything>._private`, or an underscore name imported from ray, or an underscore keyword passed to ray.init
PRIVATE_USE = re.compile(r"ray(\.\w+)*\._\w+|from ray[\w.]* import .*\b_\w+|_metrics_export_port|_node_ip_address")


def _resolve(module: str, attribute: str):
    obj = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(("module", "attribute"), list(ray_adapter.PRIVATE_API))
def test_the_private_ray_api_the_adapter_uses_still_exists(module: str, attribute: str) -> None:
    fn = _resolve(module, attribute)
    params = inspect.signature(fn).parameters
    # ray.init takes its underscore options through **kwargs: they must still be read by name in its source
    source = inspect.getsource(fn)
    missing = [p for p in ray_adapter.PRIVATE_API[(module, attribute)]
               if p not in params and f'"{p}"' not in source]
    assert not missing, f"{module}.{attribute} no longer takes {missing}: update services/common/ray_adapter.py"


def test_no_module_but_the_adapter_uses_private_ray_api() -> None:
    offenders = []
    for folder in ("services", "shared", "kernels", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "ray_adapter.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if PRIVATE_USE.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "private Ray API outside services/common/ray_adapter.py:\n" + "\n".join(offenders)


def test_the_offender_pattern_catches_the_usual_spellings() -> None:
    assert PRIVATE_USE.search("from ray.serve._private.api import serve_start")
    assert PRIVATE_USE.search("from ray.serve.context import _get_serve_request_context")
    assert PRIVATE_USE.search("ray.init(_node_ip_address='127.0.0.1')")
    assert not PRIVATE_USE.search("from ray.serve.config import gRPCOptions")


WORKER_PATHS = """
import importlib.util, json, os, sys

from genserve.services.common import ray_adapter

ray_adapter.init_local_ray(metrics_port=0, num_cpus=1, include_dashboard=False, dashboard_port=0,
                           log_to_driver=False, namespace="test-paths", object_store_memory=80 * 2**20)
import ray

@ray.remote
def where():
    return {"path": sys.path, "kernels": importlib.util.find_spec("kernels").origin}

print(json.dumps({**ray.get(where.remote()), "cwd": os.getcwd()}))
ray.shutdown()
"""


@pytest.mark.slow
def test_ray_workers_started_from_the_checkout_do_not_see_its_folders_as_top_level_packages() -> None:
    """Ray puts the driver's working directory first on its workers' sys.path; from the checkout's root that would
    make kernels/ shadow Hugging Face's `kernels` in every replica."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-P", "-c", WORKER_PATHS], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert str(ROOT) not in got["path"]
    assert "site-packages" in got["kernels"] and not got["kernels"].startswith(str(ROOT / "kernels"))
    assert got["cwd"] == str(ROOT)  # the driver is back where it started
