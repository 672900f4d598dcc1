"""Captioned shapes: a deterministic, seeded generator of 32×32 RGB images with their captions and attributes.

Every image shows one shape (``SHAPES``) in one palette colour (``COLOURS``), at one of two sizes (``SIZES``) and one
of five named positions (``POSITIONS``), on a light, lightly graded background. 4 × 6 × 2 × 5 = 240 captions such as
"a large red circle at the top left". The generative models (VAE, GAN, diffusion) train on it and the attribute
reader (``genserve.services.shapes.reader``) scores their samples against it.

Splits. ``train`` and ``heldout`` draw from *different RNG streams* of the same seed: the stream is
``numpy.random.SeedSequence(seed, spawn_key=(split_index,))`` with ``train`` = 0 and ``heldout`` = 1. The two streams
are statistically independent, so held-out images (their jitter, colour tint and background) are never seen in
training even though every attribute combination can appear in both.

Rendering is anti-aliased: each shape is rasterised on a 4× supersampled grid and box-filtered down, so its edge
pixels blend with the background by their coverage.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import torch

IMAGE_SIZE = 32
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (210, 40, 40),
    "green": (40, 150, 60),
    "blue": (40, 80, 210),
    "yellow": (230, 190, 30),
    "purple": (130, 60, 170),
    "orange": (235, 120, 30),
}
SIZES: tuple[str, ...] = ("small", "large")
# Position name -> anchor (x, y) of the shape's bounding-box centre, in pixels.
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (10.0, 10.0),
    "top right": (22.0, 10.0),
    "center": (16.0, 16.0),
    "bottom left": (10.0, 22.0),
    "bottom right": (22.0, 22.0),
}
SPLITS: dict[str, int] = {"train": 0, "heldout": 1}
# The attributes a caption names, in its word order.
CAPTION_ATTRIBUTES: tuple[str, ...] = ("size", "colour", "shape", "position")

# Half-extent of the shape's bounding box, in pixels (bounding box is 2·h wide); jittered by ±SIZE_JITTER.
HALF_EXTENT = {"small": 4.5, "large": 7.75}
SIZE_JITTER = 0.06
POSITION_JITTER = 1.5  # pixels, uniform on each axis; anchors stay ≥ 8 px apart, so position is never ambiguous
COLOUR_JITTER = 10  # per channel, uniform
SUPERSAMPLE = 4

_CAPTION_RE = re.compile(
    r"^an? (?P<size>{}) (?P<colour>{}) (?P<shape>{}) (?:at|in) the (?P<position>{})$".format(
        "|".join(SIZES), "|".join(COLOURS), "|".join(SHAPES), "|".join(POSITIONS)
    )
)


def all_attribute_combinations() -> list[dict[str, str]]:
    """Every (shape, colour, size, position) combination, in a fixed order (240 of them)."""
    return [
        {"shape": s, "colour": c, "size": z, "position": p}
        for s, c, z, p in itertools.product(SHAPES, COLOURS, SIZES, POSITIONS)
    ]


def position_phrase(position: str) -> str:
    """The position phrase of a caption: "at the top left", "in the center"."""
    return f"{'in' if position == 'center' else 'at'} the {position}"


def caption(attrs: dict[str, str]) -> str:
    """The caption of ``attrs``, e.g. "a large red circle at the top left" or "a small blue cross in the center"."""
    return f"a {attrs['size']} {attrs['colour']} {attrs['shape']} {position_phrase(attrs['position'])}"


def partial_caption(attrs: dict[str, str]) -> str:
    """The caption of whichever of size, colour, shape and position ``attrs`` names, in ``caption``'s grammar and
    order, the others left out: "a green square", "a square at the bottom right", "a large circle at the top left",
    "a red" (no shape), "at the top left" (position only). With all four it equals ``caption``; with none it is the
    empty caption. The article stays "a", as in every full caption."""
    words = [attrs[key] for key in ("size", "colour", "shape") if attrs.get(key)]
    parts = [f"a {' '.join(words)}"] if words else []
    if attrs.get("position"):
        parts.append(position_phrase(attrs["position"]))
    return " ".join(parts)


def attribute_subset(attrs: dict[str, str], mask: int) -> dict[str, str]:
    """The attributes of ``attrs`` whose bit is set in ``mask`` (bit i: ``CAPTION_ATTRIBUTES[i]``); 15 = all four."""
    return {key: attrs[key] for i, key in enumerate(CAPTION_ATTRIBUTES) if mask >> i & 1}


def parse_caption(text: str) -> dict[str, str] | None:
    """Inverse of ``caption``: the attributes a caption names, or None if it is not a dataset caption."""
    match = _CAPTION_RE.match(" ".join(text.lower().split()))
    return None if match is None else match.groupdict()


def _shape_mask(shape: str, dx: np.ndarray, dy: np.ndarray, h: float) -> np.ndarray:
    """Inside-test for a shape whose bounding box is [-h, h]² around the origin (y grows downwards)."""
    if shape == "circle":
        return dx * dx + dy * dy <= h * h
    if shape == "square":
        return (np.abs(dx) <= h) & (np.abs(dy) <= h)
    if shape == "triangle":
        # Apex at (0, -h), base from (-h, h) to (h, h): the half-width grows linearly from 0 to h.
        return (dy >= -h) & (dy <= h) & (np.abs(dx) <= (dy + h) / 2)
    if shape == "cross":
        arm = h / 3
        return ((np.abs(dx) <= h) & (np.abs(dy) <= arm)) | ((np.abs(dy) <= h) & (np.abs(dx) <= arm))
    raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")


def coverage(shape: str, cx: float, cy: float, h: float) -> np.ndarray:
    """Fraction of each pixel covered by the shape, (32, 32) float in [0, 1], by 4× supersampling."""
    n = IMAGE_SIZE * SUPERSAMPLE
    centres = (np.arange(n) + 0.5) / SUPERSAMPLE  # sub-pixel centres in pixel units
    mask = _shape_mask(shape, centres[None, :] - cx, centres[:, None] - cy, h).astype(np.float32)
    return mask.reshape(IMAGE_SIZE, SUPERSAMPLE, IMAGE_SIZE, SUPERSAMPLE).mean(axis=(1, 3))


def _background(rng: np.random.Generator) -> np.ndarray:
    """A light grey-to-beige background with a faint linear gradient, (32, 32, 3) float."""
    level = rng.uniform(212, 240)
    warmth = rng.uniform(0, 10)
    base = np.array([level + warmth / 2, level, level - warmth], dtype=np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    amplitude = rng.uniform(0, 6)
    grid = (np.arange(IMAGE_SIZE, dtype=np.float32) + 0.5) / IMAGE_SIZE - 0.5
    ramp = amplitude * (np.cos(angle) * grid[None, :] + np.sin(angle) * grid[:, None]) * 2
    return base[None, None, :] + ramp[:, :, None]


def render(attrs: dict[str, str], rng: np.random.Generator) -> np.ndarray:
    """Draw one image with the given attributes; ``rng`` supplies jitter and background. (32, 32, 3) uint8."""
    for key, allowed in (("shape", SHAPES), ("colour", COLOURS), ("size", SIZES), ("position", POSITIONS)):
        if attrs.get(key) not in allowed:
            raise ValueError(f"{key} must be one of {tuple(allowed)}, got {attrs.get(key)!r}")
    ax, ay = POSITIONS[attrs["position"]]
    cx = ax + rng.uniform(-POSITION_JITTER, POSITION_JITTER)
    cy = ay + rng.uniform(-POSITION_JITTER, POSITION_JITTER)
    h = HALF_EXTENT[attrs["size"]] * (1 + rng.uniform(-SIZE_JITTER, SIZE_JITTER))
    colour = np.asarray(COLOURS[attrs["colour"]], dtype=np.float32) + rng.uniform(-COLOUR_JITTER, COLOUR_JITTER, 3)
    alpha = coverage(attrs["shape"], cx, cy, h)[:, :, None]  # (32, 32, 1)
    image = _background(rng) * (1 - alpha) + colour[None, None, :] * alpha
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def split_rng(seed: int, split: str) -> np.random.Generator:
    """The RNG stream of ``split`` for ``seed`` (see the module docstring)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {tuple(SPLITS)}, got {split!r}")
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(SPLITS[split],)))


def sample_attributes(rng: np.random.Generator) -> dict[str, str]:
    """Uniformly random attributes (each attribute independent, so all 240 combinations are equally likely)."""
    return {
        "shape": SHAPES[rng.integers(len(SHAPES))],
        "colour": tuple(COLOURS)[rng.integers(len(COLOURS))],
        "size": SIZES[rng.integers(len(SIZES))],
        "position": tuple(POSITIONS)[rng.integers(len(POSITIONS))],
    }


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, 32, 32, 3) -> float (N, 3, 32, 32) in [-1, 1]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """float (N, 3, 32, 32) in [-1, 1] -> uint8 (N, 32, 32, 3); values outside [-1, 1] are clipped."""
    scaled = images.detach().float().clamp(-1, 1).add(1).mul(127.5).round()
    return scaled.permute(0, 2, 3, 1).to(torch.uint8).cpu().numpy()


def sample_batch(n: int, seed: int, split: str = "train") -> tuple[torch.Tensor, list[str], list[dict[str, str]]]:
    """``n`` images of ``split`` from ``seed``: (images (N, 3, 32, 32) float in [-1, 1], captions, attributes)."""
    rng = split_rng(seed, split)
    attrs = [sample_attributes(rng) for _ in range(n)]
    images = np.stack([render(a, rng) for a in attrs]) if n else np.zeros((0, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    return to_tensor(images), [caption(a) for a in attrs], attrs
