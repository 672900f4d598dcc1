"""The deployment files, parsed once per test session. No Docker engine or cluster is needed."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
SERVE_CONFIGS = {"gpu": ROOT / "deploy" / "serve_config.yaml", "local": ROOT / "deploy" / "serve_config.local.yaml"}


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="session")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="session")
def gpu_serve_config() -> dict:
    return yaml.safe_load(SERVE_CONFIGS["gpu"].read_text())


@pytest.fixture(scope="session")
def local_serve_config() -> dict:
    return yaml.safe_load(SERVE_CONFIGS["local"].read_text())


@pytest.fixture(scope="session")
def rayservice() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "kuberay" / "rayservice.yaml").read_text())


@pytest.fixture(scope="session")
def rayservice_tls() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "kuberay" / "rayservice.tls.yaml").read_text())


@pytest.fixture(scope="session")
def tls_front_config_map() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "kuberay" / "tls-front.yaml").read_text())
