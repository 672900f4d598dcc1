"""Prepare the GPU check for the GPU check machine (issue 37), on this CPU machine: download, for its Python 3.12,
the wheels of what the check needs and that machine lacks into .whl/ (git-ignored; the device tool carries it), then
print the one command to run there.

    .venv/bin/python -P bench/gpu_prepare.py [--dest .whl]

That machine (docs/benchmarks.md) has Python 3.12.3 with torch 2.11.0+cu130, Triton 3.6.0, numpy, safetensors,
tokenizers, transformers, pytest, pyyaml, pillow, jinja2, requests, regex, filelock, huggingface-hub and tqdm, and no
network. The check (bench/gpu_check.py --device-run) imports genserve's model code, transformers and diffusers, and
never Ray, gRPC's server side or the HTTP stack.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the check needs that the machine lacks, at the versions this project's tests run with (.venv): gguf (the text
# loader imports its reader), diffusers (the diffusion twin) and diffusers' importlib_metadata with its one need
# that the machine lacks, lazy-importer.
WHEELS = {
    "gguf": "0.19.0",
    "diffusers": "0.42.1",
    "importlib_metadata": "10.2.0",
    "lazy-importer": "0.1.0",
}
# The GPU machine's packages that the check or the wheels above import (its image's list, read 2026-11-17).
ON_MACHINE = frozenset({"numpy", "pyyaml", "requests", "tqdm", "filelock", "huggingface-hub", "regex", "safetensors",
                        "pillow", "zipp", "typing-extensions", "torch", "triton", "transformers", "tokenizers",
                        "pytest", "jinja2", "protobuf", "grpcio"})
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
CARRY_LIMIT_BYTES = 64 * 2**20  # what one device call carries, the working tree included
DEVICE_COMMAND = "bash bench/gpu_device.sh"


def download_command(dest: Path, name: str, version: str) -> list[str]:
    """pip download of one pure or manylinux x86-64 wheel for CPython 3.12, without its needs (named in WHEELS)."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
            "3.12", "--implementation", "cp", *platforms, "-d", str(dest), f"{name}=={version}"]


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_")


def stale(dest: Path) -> list[Path]:
    """Wheels in `dest` that WHEELS does not name at its version: two versions of one package stop the install."""
    wanted = {(_normalized(n), v) for n, v in WHEELS.items()}
    return [w for w in dest.glob("*.whl") if (_normalized(w.name.split("-")[0]), w.name.split("-")[1]) not in wanted]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl")
    args = parser.parse_args(argv)
    args.dest.mkdir(exist_ok=True)
    for old in stale(args.dest):
        old.unlink()
    for name, version in WHEELS.items():
        subprocess.run(download_command(args.dest, name, version), check=True)
    wheels = sorted(args.dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    if size > CARRY_LIMIT_BYTES // 2:
        print(f"{size / 2**20:.1f} MiB of wheels leaves too little of the {CARRY_LIMIT_BYTES // 2**20} MiB a device "
              "call carries for the working tree", file=sys.stderr)
        return 1
    print("\n".join(f"  {w.name}" for w in wheels))
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB, in {args.dest}. On the GPU machine (the device tool: "
          f"carry [\"{args.dest.relative_to(ROOT) if args.dest.is_relative_to(ROOT) else args.dest}\"]), run:")
    print(DEVICE_COMMAND)
    return 0


if __name__ == "__main__":
    sys.exit(main())
