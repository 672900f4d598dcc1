"""Engine settings travel from a serve config's `args` to the running replica, and a bad one stops the deploy with
the field named (services/text/settings.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from genserve.services.client import Client
from tests.e2e.serve_configs import serve_config

KV_BUDGET = 3 * 2**20


def _text_only_config(tmp_path: Path, **text_args: object) -> Path:
    return serve_config(tmp_path, ("text",), {"text": text_args})


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


def test_an_invalid_setting_fails_the_deploy_naming_the_field(serve, base_port: int, tmp_path: Path) -> None:
    config = _text_only_config(tmp_path, dtype="float8", max_running=0)
    with pytest.raises(RuntimeError, match=r"exit code 1\)"):
        with serve(base_port + 30, tmp_path / "serve.log", "--config", str(config)):
            pass
    log = (tmp_path / "serve.log").read_text()
    assert "applications failed: text:" in log
    assert "dtype" in log and "max_running" in log
