"""Engine settings travel from a serve config's `args` to the running replica, and a bad one stops the deploy with
the field named (services/text/settings.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from services.client import Client
from services.common.deploy_config import LOCAL_PATH

ROOT = Path(__file__).resolve().parents[2]
KV_BUDGET = 3 * 2**20


def _text_only_config(tmp_path: Path, **text_args: object) -> Path:
    config = yaml.safe_load(LOCAL_PATH.read_text())
    config["applications"] = [app for app in config["applications"] if app["name"] == "text"]
    config["applications"][0]["args"].update(text_args)
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_dtype_and_kv_budget_from_the_serve_config_take_effect(serve, base_port: int, tmp_path: Path) -> None:
    config = _text_only_config(tmp_path, dtype="bfloat16", kv_cache_bytes=KV_BUDGET, max_running=7)
    with serve(base_port + 20, tmp_path / "serve.log", "--config", str(config)) as stack:
        with Client(stack.address, timeout=60) as client:
            info = client.model_info()
            reply = client.generate("The", max_tokens=3, temperature=0.0)
    assert info.dtype == "bfloat16"
    assert info.max_running == 7
    per_block = info.kv_cache_bytes // info.kv_blocks_total
    assert info.kv_cache_bytes == info.kv_blocks_total * per_block
    assert info.kv_cache_bytes <= KV_BUDGET < info.kv_cache_bytes + per_block
    assert len(reply.token_ids) == 3


def test_an_invalid_setting_fails_the_deploy_naming_the_field(base_port: int, tmp_path: Path) -> None:
    config = _text_only_config(tmp_path, dtype="float8", max_running=0)
    port = base_port + 30
    done = subprocess.run(
        [sys.executable, "-m", "services.serve", "--config", str(config), "--grpc-port", str(port),
         "--health-port", str(port + 1), "--http-port", str(port - 1000), "--metrics-port", str(port - 998),
         "--timeout", "120"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 1
    assert "applications failed: text:" in done.stderr
    assert "dtype" in done.stderr and "max_running" in done.stderr
