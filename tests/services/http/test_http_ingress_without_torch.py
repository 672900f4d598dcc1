"""The HTTP ingress loads no model, so it imports no model code: with torch and triton made unimportable, the
ingress app, its wire schemas and the client SDK import, and a request body validates against the text and diffusion
services' own limits."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent("""
    import importlib.abc, json, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "triton"):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
            return None

    sys.meta_path.insert(0, Block())

    import pydantic

    import genserve.services.client.aio
    import genserve.services.client.cli
    import genserve.services.client.sync
    from genserve.services.http.app import build
    from genserve.services.http.schemas import ChatBody
    from genserve.services.text.schema import TextIn

    ChatBody.model_validate({"model": "text", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
    try:
        TextIn.model_validate({"prompt": "Hi", "logprobs": 6})
        refused = None
    except pydantic.ValidationError as exc:
        refused = exc.errors()[0]["loc"][0]
    print(json.dumps({"build": callable(build), "refused": refused,
                      "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton"))}))
""")


def test_the_ingress_and_the_sdk_import_without_torch() -> None:
    done = subprocess.run([sys.executable, "-P", "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"build": True, "refused": "logprobs", "loaded": []}
