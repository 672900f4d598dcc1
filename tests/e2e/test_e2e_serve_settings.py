"""A bad engine setting in a serve config's `args` stops `make serve` with the field named (services/text/settings.py),
checked while Ray starts and before anything is deployed (services/serve.py, args_errors). Good ones reaching the
replica: tests/services/text/test_text_settings.py, and end to end on the DeepSeek stack
(tests/e2e/test_e2e_architectures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.serve_configs import serve_config


def test_an_invalid_setting_fails_the_deploy_naming_the_field(serve, base_port: int, tmp_path: Path) -> None:
    config = serve_config(tmp_path, ("text",), {"text": {"dtype": "float8", "max_running": 0}})
    with pytest.raises(RuntimeError, match=r"exit code 1\)"):
        with serve(base_port + 30, tmp_path / "serve.log", "--config", str(config)):
            pass
    log = (tmp_path / "serve.log").read_text()
    assert "applications failed: text:" in log
    assert "dtype" in log and "max_running" in log
    assert "Deploying app" not in log  # Serve never saw the config
