"""deploy/tls/*.json, the front of docker-compose.yml and the KubeRay sidecar: Caddy itself accepts them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from genserve.services.common import tls_front
from tests.services.common.tls_certs import make_pki


@pytest.mark.parametrize("name", sorted(tls_front.DEPLOY_CONFIGS))
def test_caddy_validates_the_deploy_config(name: str, root: Path, tmp_path: Path) -> None:
    """`caddy validate` provisions every module (certificates loaded, client CA pool built) without listening; the
    mounted paths are pointed at a throwaway PKI."""
    pki = make_pki(tmp_path / "pki")
    text = (root / "deploy" / "tls" / name).read_text()
    for mounted, local in ((tls_front.CONTAINER_FILES["cert"], pki.server.cert),
                           (tls_front.CONTAINER_FILES["key"], pki.server.key),
                           (tls_front.CONTAINER_FILES["client_ca"], pki.ca),
                           ("/data/caddy", tmp_path / "data")):
        text = text.replace(f'"{mounted}"', json.dumps(str(local)))
    config = tmp_path / name
    config.write_text(text)
    result = subprocess.run([tls_front.caddy_binary(), "validate", "--config", str(config)], capture_output=True,
                            text=True, timeout=60, env={"GENSERVE_TLS_UPSTREAM": "127.0.0.1", "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Valid configuration" in result.stdout + result.stderr


def test_caddy_rejects_a_broken_config(root: Path, tmp_path: Path) -> None:
    """The check above can fail: a certificate path that does not exist is refused."""
    config = tmp_path / "caddy.json"
    config.write_text((root / "deploy" / "tls" / "caddy.json").read_text())
    result = subprocess.run([tls_front.caddy_binary(), "validate", "--config", str(config)], capture_output=True,
                            text=True, timeout=60, env={"HOME": str(tmp_path)})
    assert result.returncode != 0 and "/certs/tls.crt" in result.stderr
