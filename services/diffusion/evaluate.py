"""Prompt adherence of the diffusion model, read back by the project's attribute reader.

Prompts are drawn from the held-out RNG stream of the shapes dataset (``split_rng(seed, "heldout")``), generated at
the given sampler settings, decoded with the VAE and read with ``genserve.services.shapes.reader``; the score per
attribute is the fraction of images whose read attribute equals the prompt's ("all": all four right).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from genserve.services.common.weights import committed_weights
from genserve.services.diffusion.params import MAX_BATCH
from genserve.services.diffusion.pipeline import DiffusionPipeline
from genserve.services.shapes.dataset import caption, sample_attributes, split_rng
from genserve.services.shapes.reader import accuracy, read_batch
from genserve.shared.blocks.autoencoder import VAE, load_autoencoder


def heldout_prompts(n: int, seed: int = 0) -> tuple[list[str], list[dict[str, str]]]:
    """``n`` captions and their attributes from the held-out stream of ``seed``."""
    rng = split_rng(seed, "heldout")
    attrs = [sample_attributes(rng) for _ in range(n)]
    return [caption(a) for a in attrs], attrs


@torch.inference_mode()
def generate_images(pipe: DiffusionPipeline, vae: VAE, prompts: list[str], *, steps: int, guidance_scale: float,
                    seed: int, scheduler: str, negative_prompts: list[str] | None = None,
                    guidance: str | None = None, negative_weight: float | None = None) -> torch.Tensor:
    """Images (N, 3, 32, 32) in [-1, 1] for ``prompts``, batch i seeded with ``seed + i`` (so the same prompts get
    the same initial noise whatever the negatives and the guidance mode)."""
    images = []
    for i in range(0, len(prompts), MAX_BATCH):
        negatives = None if negative_prompts is None else negative_prompts[i : i + MAX_BATCH]
        latents = pipe.generate(prompts[i : i + MAX_BATCH], negatives, steps=steps, guidance_scale=guidance_scale,
                                seed=seed + i // MAX_BATCH, scheduler=scheduler, guidance=guidance,
                                negative_weight=negative_weight)
        images.append(vae.decode(latents.to(next(vae.parameters()).device)).clamp(-1, 1).cpu())
    return torch.cat(images)


def evaluate(n_prompts: int = 200, steps: int = 20, guidance_scale: float = 3.0, seed: int = 0,
             scheduler: str = "ddim", pipeline: DiffusionPipeline | None = None, vae: VAE | None = None) -> dict:
    """Accuracies {shape, colour, size, position, all} over ``n_prompts`` held-out prompts, plus timing.

    ``pipeline``/``vae`` default to the committed weights (services/diffusion/weights, services/vae/weights).
    """
    pipe = pipeline or DiffusionPipeline.from_dir()
    vae = vae or load_autoencoder(committed_weights("vae"))
    prompts, attrs = heldout_prompts(n_prompts, seed)
    started = time.perf_counter()
    images = generate_images(pipe, vae, prompts, steps=steps, guidance_scale=guidance_scale, seed=seed,
                             scheduler=scheduler)
    seconds = time.perf_counter() - started
    scores = accuracy(read_batch(images), attrs)
    return {**scores, "n_prompts": n_prompts, "steps": steps, "guidance_scale": guidance_scale,
            "scheduler": scheduler, "seconds_per_image": seconds / n_prompts}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m genserve.services.diffusion.evaluate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default=None, help="diffusion checkpoint directory (default: committed)")
    parser.add_argument("--vae", default=committed_weights("vae"), help="VAE checkpoint directory (default: committed)")
    parser.add_argument("--n-prompts", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance-scale", type=float, default=3.0)
    parser.add_argument("--scheduler", default="ddim")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = evaluate(args.n_prompts, args.steps, args.guidance_scale, args.seed, args.scheduler,
                      DiffusionPipeline.from_dir(args.weights), load_autoencoder(args.vae))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
