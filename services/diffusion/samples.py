"""Sample grids for the docs: a fixed list of prompts, and one prompt with and without guidance.

    python -m genserve.services.diffusion.samples [--weights DIR] [--vae DIR] [--out docs/img]

writes ``diffusion_samples.png`` (each fixed prompt, one row per seed) and ``diffusion_guidance.png`` (one prompt,
guidance scales 1 (none), 3 and 5 by row, the same seeds across rows), both 20-step DDIM.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from genserve.services.common.weights import committed_weights
from genserve.services.diffusion.evaluate import generate_images
from genserve.services.diffusion.pipeline import DiffusionPipeline
from genserve.services.shapes.grid import save_grid
from genserve.shared.blocks.autoencoder import VAE, load_autoencoder

DOC_PROMPTS = (
    "a large red circle at the top left",
    "a small blue square at the bottom right",
    "a large green triangle in the center",
    "a small yellow cross at the top right",
    "a large purple square at the bottom left",
    "a small orange circle in the center",
    "a large blue cross at the top left",
    "a small red triangle at the bottom right",
)
GUIDANCE_PROMPT = "a large blue square at the bottom right"
GUIDANCE_SCALES = (1.0, 3.0, 5.0)


def prompt_grid(pipe: DiffusionPipeline, vae: VAE, path: Path, seeds: int = 3, guidance_scale: float = 3.0) -> Path:
    """Columns: DOC_PROMPTS; rows: seeds 0..seeds-1."""
    rows = [generate_images(pipe, vae, list(DOC_PROMPTS), steps=20, guidance_scale=guidance_scale, seed=s,
                            scheduler="ddim") for s in range(seeds)]
    return save_grid(torch.cat(rows), path, n_cols=len(DOC_PROMPTS), scale=3)


def guidance_grid(pipe: DiffusionPipeline, vae: VAE, path: Path, n: int = 8) -> Path:
    """Rows: GUIDANCE_SCALES; columns: n samples of GUIDANCE_PROMPT (the same initial noise in every row)."""
    rows = [generate_images(pipe, vae, [GUIDANCE_PROMPT] * n, steps=20, guidance_scale=w, seed=0, scheduler="ddim")
            for w in GUIDANCE_SCALES]
    return save_grid(torch.cat(rows), path, n_cols=n, scale=3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default=None)
    parser.add_argument("--vae", default=committed_weights("vae"))
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pipe, vae = DiffusionPipeline.from_dir(args.weights), load_autoencoder(args.vae)
    print(prompt_grid(pipe, vae, args.out / "diffusion_samples.png"))
    print(guidance_grid(pipe, vae, args.out / "diffusion_guidance.png"))


if __name__ == "__main__":
    main()
