"""The committed stubs are exactly what `make protos` generates from the .proto files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("protos_generate", Path(__file__).resolve().parents[2] / "protos" /
                                               "generate.py")
protogen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(protogen)


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    generated = protogen.generate(tmp_path)
    committed = sorted(p.relative_to(protogen.PROTO_ROOT) for p in protogen.PROTO_DIR.glob("*_pb2*.py*"))
    assert generated == committed, "stub files differ: run `make protos`"
    stale = [str(p) for p in generated if (tmp_path / p).read_bytes() != (protogen.PROTO_ROOT / p).read_bytes()]
    assert not stale, f"stale stubs (run `make protos`): {stale}"


def test_every_service_file_has_stubs() -> None:
    names = {p.stem for p in protogen.proto_files()}
    assert names == {"common", "text", "gan", "vae", "diffusion"}
    for name in names:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert (protogen.PROTO_DIR / f"{name}{suffix}").is_file()
