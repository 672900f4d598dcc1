"""`pip install "genserve[client]"` is enough to call a server: the SDK and the CLI, run in a process where torch,
Ray and the other server-side packages cannot be imported, talk to the real stack."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("torch", "triton", "ray", "numpy", "pydantic", "safetensors", "tokenizers", "PIL", "jinja2", "yaml")

# Any import of a server-side package fails, as it would where only the client extra is installed.
BLOCKER = textwrap.dedent(f"""
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {SERVER_ONLY!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (client-only install)")
            return None

    sys.meta_path.insert(0, Block())
""")


def _client_only(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_the_client_extra_needs_no_server_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    client = project["dependencies"] + project["optional-dependencies"]["client"]
    names = {Requirement(r).name.lower() for r in client}
    assert names.isdisjoint({"torch", "triton", "ray", "numpy", "pydantic", "safetensors", "tokenizers", "pillow"})
    assert {"grpcio", "protobuf"} <= names


def test_cli_and_sdk_call_the_stack_without_torch_or_ray(stack, tmp_path: Path) -> None:
    out = tmp_path / "gan.png"
    done = _client_only(f"""
        import json
        from genserve.services.client import Client
        from genserve.services.client.cli import main

        assert main(["--address", "{stack.address}", "gan", "-n", "1", "--seed", "5", "-o", "{out}"]) == 0
        with Client("{stack.address}", timeout=60) as client:
            reply = client.generate("The", max_tokens=4, temperature=0.0)
        print(json.dumps({{"text": reply.text, "tokens": len(reply.token_ids), "modules": sorted(
            m for m in sys.modules if m.split(".")[0] in {SERVER_ONLY!r})}}))
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 4 and result["modules"] == []
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_blocker_blocks() -> None:
    """The check above would prove nothing if the blocked packages could still be imported."""
    done = _client_only("import torch")
    assert done.returncode != 0 and "client-only install" in done.stderr
