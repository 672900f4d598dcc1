"""`make protos` (``python protos/generate.py``): regenerate the committed gRPC stubs from
protos/genserve/v1/*.proto with grpcio-tools (a dev dependency: a build tool, never imported when serving).

The stubs (`*_pb2.py`, `*_pb2_grpc.py`, `*_pb2.pyi`) are committed so that serving needs no code generation;
tests/protos/test_protos_fresh.py regenerates them into a temporary folder and fails when they differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_DIR = PROTO_ROOT / "genserve" / "v1"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc on every .proto; return the generated files (relative to `out_root`), sorted."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    sources = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")
    out_dir = out_root / "genserve" / "v1"
    return sorted(p.relative_to(out_root) for p in out_dir.glob("*_pb2*.py*"))


def main() -> int:
    for path in generate():
        print(f"wrote protos/{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
