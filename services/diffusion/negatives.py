"""Negative-prompt adherence and steering of the diffusion model, read back by the attribute reader.

Two questions, on the held-out prompts and seeds of ``genserve.services.diffusion.evaluate`` (issue 18):
- adherence: does a negative prompt leave what the prompt asks for intact? Prompt i is paired with a negative that
  names another colour ("a green square" for a yellow square), another shape ("a yellow circle") or another
  position ("a square at the bottom right"), by i mod 3, the other value drawn from a seeded RNG; and, separately,
  with the generic negative "a blurry image". The score per attribute is as in ``evaluate``.
- steering: for prompts that leave the colour open ("a large circle at the top left"), how often the colour a
  negative names ("a red circle") appears with that negative and without any. The named colour is the one the
  same seed draws without the negative, so "without" is the fraction of readable colours (1 but for unreadable
  ones) and "with" says how often the negative failed to move the colour away from it.
"""

from __future__ import annotations

import numpy as np

from genserve.services.diffusion.evaluate import generate_images, heldout_prompts
from genserve.services.diffusion.pipeline import DiffusionPipeline
from genserve.services.shapes.dataset import COLOURS, POSITIONS, SHAPES, partial_caption
from genserve.services.shapes.reader import accuracy, read_batch
from genserve.shared.blocks.autoencoder import VAE

NEGATIVE_KINDS = ("colour", "shape", "position")
GENERIC_NEGATIVE = "a blurry image"


def _other(rng: np.random.Generator, values: tuple[str, ...], excluded: str) -> str:
    choices = [v for v in values if v != excluded]
    return choices[rng.integers(len(choices))]


def contrasting_negative(attrs: dict[str, str], kind: str, rng: np.random.Generator) -> str:
    """A negative naming another ``kind`` ("colour", "shape" or "position") than ``attrs`` asks for."""
    if kind == "colour":
        return partial_caption({"colour": _other(rng, tuple(COLOURS), attrs["colour"]), "shape": attrs["shape"]})
    if kind == "shape":
        return partial_caption({"colour": attrs["colour"], "shape": _other(rng, SHAPES, attrs["shape"])})
    if kind == "position":
        return partial_caption({"shape": attrs["shape"], "position": _other(rng, tuple(POSITIONS), attrs["position"])})
    raise ValueError(f"kind must be one of {NEGATIVE_KINDS}, got {kind!r}")


def contrasting_negatives(attrs: list[dict[str, str]], seed: int = 0) -> list[str]:
    """One negative per prompt: another colour, shape, position for prompts 0, 1, 2 (mod 3); seeded."""
    rng = np.random.default_rng(seed)
    return [contrasting_negative(a, NEGATIVE_KINDS[i % 3], rng) for i, a in enumerate(attrs)]


def open_colour_prompt(attrs: dict[str, str]) -> str:
    """The caption of ``attrs`` without its colour, e.g. "a large circle at the top left"."""
    return partial_caption({key: attrs[key] for key in ("size", "shape", "position")})


def adherence(pipe: DiffusionPipeline, vae: VAE, negatives: str, *, n_prompts: int = 200, guidance: str | None = None,
              steps: int = 20, guidance_scale: float = 3.0, seed: int = 0, scheduler: str = "ddim",
              negative_weight: float | None = None) -> dict[str, float]:
    """Per-attribute accuracy with ``negatives`` "none", "contrasting" (another colour / shape / position) or
    "generic" (``GENERIC_NEGATIVE``) on the held-out prompts of ``seed``."""
    prompts, attrs = heldout_prompts(n_prompts, seed)
    negative_prompts = {"none": None, "contrasting": contrasting_negatives(attrs, seed),
                        "generic": [GENERIC_NEGATIVE] * n_prompts}[negatives]
    images = generate_images(pipe, vae, prompts, steps=steps, guidance_scale=guidance_scale, seed=seed,
                             scheduler=scheduler, negative_prompts=negative_prompts, guidance=guidance,
                             negative_weight=negative_weight)
    return accuracy(read_batch(images), attrs)


Reads = list[dict[str, str | None]]


def open_colour_reads(pipe: DiffusionPipeline, vae: VAE, *, n_prompts: int = 200, steps: int = 20,
                      guidance_scale: float = 3.0, seed: int = 0, scheduler: str = "ddim") -> Reads:
    """What the reader sees on the colour-open prompts without a negative (the same in every guidance mode)."""
    _, attrs = heldout_prompts(n_prompts, seed)
    return read_batch(generate_images(pipe, vae, [open_colour_prompt(a) for a in attrs], steps=steps,
                                      guidance_scale=guidance_scale, seed=seed, scheduler=scheduler))


def steering(pipe: DiffusionPipeline, vae: VAE, before: Reads, *, guidance: str | None = None,
             steps: int = 20, guidance_scale: float = 3.0, seed: int = 0, scheduler: str = "ddim",
             negative_weight: float | None = None) -> dict[str, float]:
    """On the colour-open prompts, with a negative naming the colour ``before`` (``open_colour_reads``) shows
    ("a red circle"): how often that colour appears without ("without"; unreadable colours count as misses) and
    with the negative ("with"), and how often shape, size and position all stayed right with it ("kept")."""
    _, attrs = heldout_prompts(len(before), seed)
    named = [r["colour"] for r in before]
    negatives = [partial_caption({"colour": c, "shape": a["shape"]}) if c else GENERIC_NEGATIVE
                 for c, a in zip(named, attrs, strict=True)]
    after = read_batch(generate_images(pipe, vae, [open_colour_prompt(a) for a in attrs], steps=steps,
                                       guidance_scale=guidance_scale, seed=seed, scheduler=scheduler,
                                       negative_prompts=negatives, guidance=guidance,
                                       negative_weight=negative_weight))
    return {"without": float(np.mean([c is not None for c in named])),
            "with": float(np.mean([r["colour"] == c and c is not None for r, c in zip(after, named, strict=True)])),
            "kept": float(np.mean([all(r[k] == a[k] for k in ("shape", "size", "position"))
                                   for r, a in zip(after, attrs, strict=True)]))}
