"""bench/gpu_prepare.py: the wheels it carries to the GPU check machine are the versions tested here, bring every
need the machine lacks, are fetched for that machine's Python 3.12, and never two versions of one package."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

from bench.gpu_prepare import ON_MACHINE, WHEELS, download_command, stale


def _name(requirement: str) -> str:
    return re.split(r"[ <>=!;\[(~]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_carried_wheels_are_the_versions_this_venv_tests() -> None:
    assert {name: importlib.metadata.version(name) for name in WHEELS} == WHEELS


def test_every_need_of_a_carried_wheel_is_carried_or_on_the_machine() -> None:
    carried = {n.lower().replace("_", "-") for n in WHEELS}
    for name in WHEELS:
        for requirement in importlib.metadata.requires(name) or []:
            if "extra ==" in requirement:
                continue
            assert _name(requirement) in carried | ON_MACHINE, f"{name} needs {requirement}"


def test_the_download_is_for_cpython_3_12_wheels_without_their_needs(tmp_path: Path) -> None:
    command = download_command(tmp_path, "gguf", "0.19.0")
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(command)
    assert command[command.index("--python-version") + 1] == "3.12"
    assert command[command.index("--implementation") + 1] == "cp"
    assert "manylinux_2_28_x86_64" in command and command[-1] == "gguf==0.19.0"


def test_wheels_of_other_versions_are_stale(tmp_path: Path) -> None:
    names = ["gguf-0.19.0-py3-none-any.whl", "gguf-0.18.0-py3-none-any.whl", "lazy_importer-0.1.0-py3-none-any.whl",
             "diffusers-0.42.1-py3-none-any.whl", "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert sorted(p.name for p in stale(tmp_path)) == ["gguf-0.18.0-py3-none-any.whl",
                                                       "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl"]
