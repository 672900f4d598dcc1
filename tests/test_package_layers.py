"""The import arrows between genserve's packages, read from the source (every import statement, at any depth):
kernels at the bottom, the blocks above them, the services on top, and no service reaching into another's modules.
Services talk through deployment handles and the protobuf messages; the one thing a service may import from another
is its wire schema (`<service>/schema.py`: the request models, limits and error map, torch-free), as the HTTP ingress
validates a body with the very model the gRPC handler applies."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = (ROOT / "kernels", ROOT / "shared", ROOT / "services")
SERVICES = ("text", "gan", "vae", "diffusion", "http")


def imports(folder: Path) -> dict[str, set[str]]:
    """module file (relative to the root) -> every module it imports."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        found[str(path.relative_to(ROOT))] = names
    return found


def crossings(folder: Path, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    return {
        path: sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))
        for path, names in imports(folder).items()
        if any(n == f or n.startswith(f + ".") for n in names for f in forbidden)
    }


def test_the_walk_sees_the_imports_it_judges() -> None:
    found = imports(ROOT / "services" / "text")
    assert "genserve.services.text.engine.params.SamplingParams" in found["services/text/schema.py"]
    assert "torch" in found["services/text/model.py"]


def test_nothing_under_kernels_imports_the_blocks_or_the_services() -> None:
    assert crossings(ROOT / "kernels", ("genserve.shared", "genserve.services", "shared", "services")) == {}


def test_the_blocks_import_no_service_and_no_serving_library() -> None:
    forbidden = ("genserve.services", "services", "ray", "grpc", "genserve.v1")
    assert crossings(ROOT / "shared", forbidden) == {}
    assert crossings(ROOT / "kernels", forbidden) == {}


def test_no_service_imports_another_services_modules_but_its_wire_schema() -> None:
    for service in SERVICES:
        others = tuple(f"genserve.services.{other}" for other in SERVICES if other != service)
        found = {
            path: [n for n in names if not any(n == f"{o}.schema" or n.startswith(f"{o}.schema.") for o in others)]
            for path, names in crossings(ROOT / "services" / service, others).items()
        }
        assert {path: names for path, names in found.items() if names} == {}, service


def test_the_wire_schemas_import_no_model_code() -> None:
    for service in ("text", "diffusion"):
        names = imports(ROOT / "services" / service)[f"services/{service}/schema.py"]
        assert not {n.split(".")[0] for n in names} & {"torch", "triton", "numpy"}, service


def test_code_imports_the_folders_only_under_the_genserve_name() -> None:
    bare = ("kernels", "shared", "services")
    for folder in (*FOLDERS, ROOT / "bench", ROOT / "tests"):
        assert crossings(folder, bare) == {}, folder.name
