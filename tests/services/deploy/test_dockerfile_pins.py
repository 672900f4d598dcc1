"""deploy/Dockerfile installs exactly what pyproject.toml pins, on a Python that pyproject accepts, and sets Serve's
request path as `make serve` does."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from genserve.services.common.deploy_config import SERVE_ENV

DOCKERFILE = Path(__file__).resolve().parents[3] / "deploy" / "Dockerfile"


def _instructions(text: str) -> list[str]:
    """Dockerfile instructions with line continuations joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [i.strip() for i in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines() if i.strip()]


def _args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", "\n".join(_instructions(text)), re.MULTILINE))


def _pip_installs(text: str) -> list[list[str]]:
    """The argument lists of every `pip install` in a RUN instruction, ${ARG}s expanded."""
    args = _args(text)
    installs = []
    for instruction in _instructions(text):
        if not instruction.startswith("RUN "):
            continue
        for command in instruction[4:].split("&&"):
            tokens = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], command))
            if tokens[:2] == ["pip", "install"]:
                installs.append(tokens[2:])
    return installs


def _dependencies(pyproject: dict) -> dict[str, Requirement]:
    project = pyproject["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {Requirement(r).name: Requirement(r) for r in requirements}


def _named_requirements(installs: list[list[str]]) -> list[Requirement]:
    named = []
    for tokens in installs:
        skip = False
        for token in tokens:
            if skip or token.startswith("-") or token == ".":
                skip = token in ("-r", "--index-url", "--extra-index-url")
                continue
            named.append(Requirement(token))
    return named


def test_every_package_named_in_the_dockerfile_satisfies_pyproject(pyproject: dict) -> None:
    dependencies = _dependencies(pyproject)
    named = _named_requirements(_pip_installs(DOCKERFILE.read_text()))
    assert "torch" in {r.name for r in named}
    for requirement in named:
        if requirement.name == "pip":
            continue
        assert requirement.name in dependencies, f"{requirement} is not a dependency in pyproject.toml"
        pinned = [s.version for s in requirement.specifier if s.operator == "=="]
        assert pinned, f"{requirement} must be pinned with =="
        assert dependencies[requirement.name].specifier.contains(pinned[0], prereleases=True), (
            f"{requirement} is outside pyproject's {dependencies[requirement.name]}"
        )


def test_dockerfile_torch_is_the_makefile_torch(root: Path) -> None:
    makefile_spec = re.search(r"^TORCH_SPEC \?= (\S+)$", (root / "Makefile").read_text(), re.MULTILINE).group(1)
    assert _args(DOCKERFILE.read_text())["TORCH_SPEC"] == makefile_spec


@pytest.mark.parametrize("sources", [
    [("dependencies",), ("optional-dependencies", "server")],  # the serving image: base + server extra
    [("optional-dependencies", "load")],
])
def test_dockerfile_requirements_are_read_from_pyproject(sources: list[tuple[str, ...]], root: Path,
                                                         pyproject: dict) -> None:
    """Runs the Dockerfile's own extraction command on pyproject.toml: it must reproduce the pins verbatim."""
    expected = []
    for keys in sources:
        section = pyproject["project"]
        for key in keys:
            section = section[key]
        expected += section
    marker = "['project']" + "".join(f"['{key}']" for key in sources[-1]) + ")"
    commands = [
        c for i in _instructions(DOCKERFILE.read_text()) if i.startswith("RUN ")
        for c in i[4:].split("&&") if "tomllib" in c and marker in c
    ]
    assert len(commands) == 1, commands
    code, target = re.fullmatch(r'\s*python -c "(.*)"\s*>\s*(\S+)\s*', commands[0]).groups()
    output = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert output.stdout.splitlines() == expected
    installs = _pip_installs(DOCKERFILE.read_text())
    assert ["-r", target] in installs, f"{target} is written but never installed"


def test_image_python_satisfies_requires_python(pyproject: dict) -> None:
    versions = set(re.findall(r"python(3\.\d+)-venv", DOCKERFILE.read_text()))
    assert len(versions) == 1, versions
    assert SpecifierSet(pyproject["project"]["requires-python"]).contains(Version(versions.pop()))


def test_project_is_installed_without_resolving_dependencies_again() -> None:
    """The last install must not let pip pick other versions than the pinned layer above it."""
    installs = _pip_installs(DOCKERFILE.read_text())
    project = [tokens for tokens in installs if "." in tokens]
    assert project == [["--no-deps", "."]]


def test_gpu_image_sets_the_serve_env_of_make_serve() -> None:
    env: dict[str, str] = {}
    for instruction in _instructions(DOCKERFILE.read_text()):
        if instruction.startswith("ENV "):
            env |= dict(re.findall(r"(\w+)=(\S+)", instruction))
    assert {k: v for k, v in env.items() if k.startswith("RAY_SERVE_")} == SERVE_ENV


def test_the_triton_cache_is_a_folder_the_replicas_write_and_compose_keeps(root: Path) -> None:
    """Compiled kernels outlive a container (issue 37, defect 10): the image points Triton at a folder owned by the
    replicas' user, docker-compose.yml mounts a named volume there on every Ray node, and KubeRay's pods an emptyDir
    (kept across a container restart)."""
    instructions = _instructions(DOCKERFILE.read_text())
    env: dict[str, str] = {}
    for instruction in instructions:
        if instruction.startswith("ENV "):
            env |= dict(re.findall(r"(\w+)=(\S+)", instruction))
    cache = env["TRITON_CACHE_DIR"]
    commands = [c.strip() for i in instructions if i.startswith("RUN ") for c in i[4:].split("&&")]
    assert any(c.startswith("mkdir -p") and "$TRITON_CACHE_DIR" in c for c in commands)
    assert any(c.startswith("chown -R genserve:genserve") and "$TRITON_CACHE_DIR" in c for c in commands)
    compose = yaml.safe_load((root / "docker-compose.yml").read_text())
    for name in ("ray-head", "ray-worker"):
        assert f"triton-cache:{cache}" in compose["services"][name]["volumes"], name
    assert "triton-cache" in compose["volumes"]
    for manifest in ("rayservice.yaml", "rayservice.tls.yaml"):
        spec = yaml.safe_load((root / "deploy" / "kuberay" / manifest).read_text())["spec"]["rayClusterConfig"]
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            pod = group["template"]["spec"]
            assert {"name": "triton-cache", "emptyDir": {}} in pod["volumes"], manifest
            mounts = pod["containers"][0]["volumeMounts"]
            assert {"name": "triton-cache", "mountPath": cache} in mounts, manifest
