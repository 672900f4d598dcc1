"""The negative-prompt grid of the docs (docs/img/negative_prompts.png), drawn by `genserve diffuse` as a user would.

Against a running stack, each row is one prompt with one negative prompt; the columns are no negative,
`--guidance-mode cfg` and the model's default mode (Perp-Neg for the demo model, issue 18). Every image is a
`genserve diffuse` call, so the grid shows what the CLI gives, previews and all defaults included.

    make serve   # in another terminal
    .venv/bin/python -m genserve.services.diffusion.negative_grid -o docs/img/negative_prompts.png
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from genserve.services.shapes.grid import save_grid

# (prompt, negative, extra CLI options); the first row is the README's second example, the last its third.
ROWS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("a small red circle at the top left", "a green circle", ("--steps", "30", "--guidance", "4", "--seed", "1",
                                                              "--scheduler", "dpmpp_2m")),
    ("a large yellow square at the top left", "a green square", ("--seed", "1")),
    ("a large green triangle at the top left", "a red circle", ("--seed", "1")),
    ("a large yellow square at the top left", "a blurry image", ("--seed", "1")),
    ("a large circle at the top left", "a red circle", ("--seed", "5")),
)
# (column, options): no negative, plain classifier-free guidance, the model's default mode
COLUMNS: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("none", None), ("cfg", ("--guidance-mode", "cfg")), ("default", ()))


def diffuse(address: str, prompt: str, options: tuple[str, ...], path: Path) -> torch.Tensor:
    """One `genserve diffuse` call; its image as (3, H, W) in [-1, 1]."""
    genserve = Path(sys.executable).parent / "genserve"
    subprocess.run([str(genserve), "--address", address, "diffuse", prompt, *options, "-o", str(path)], check=True,
                   stdout=subprocess.DEVNULL)
    pixels = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32)
    return torch.from_numpy(pixels).permute(2, 0, 1) / 127.5 - 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:9000", help="the stack's gRPC address")
    parser.add_argument("-o", "--output", type=Path, default=Path("docs/img/negative_prompts.png"))
    parser.add_argument("--negative-weight", type=float, help="w_n of the default column (default: the model's)")
    args = parser.parse_args(argv)
    weight = () if args.negative_weight is None else ("--negative-weight", str(args.negative_weight))
    images = []
    with tempfile.TemporaryDirectory() as folder:
        for r, (prompt, negative, options) in enumerate(ROWS):
            for name, mode in COLUMNS:
                extra = () if mode is None else ("--negative", negative, *mode, *(weight if name == "default" else ()))
                images.append(diffuse(args.address, prompt, (*options, *extra), Path(folder) / f"{r}_{name}.png"))
                print(f"{prompt!r} / {negative if mode is not None else '-'!r} [{name}]", flush=True)
    print(save_grid(torch.stack(images), args.output, n_cols=len(COLUMNS), scale=4))


if __name__ == "__main__":
    main()
