"""The attribute reader: reads shape, colour, size and position back from a 32×32 image.

This is genserve's image quality metric. ``bench/quality.py`` scores every image model with it: the VAE's
reconstructions, the GAN's samples (validity and shape×colour coverage) and the diffusion model's prompt adherence
(does the picture show what the caption asked for). It is rule-based, so its verdict does not depend on any trained
weights, and it reads held-out dataset images with ≥ 98% accuracy (tested in tests/services/shapes).

The rules, in order:
1. background = per-channel median of the one-pixel border ring; foreground = pixels farther than ``FG_DISTANCE``
   from it (Euclidean RGB), and the shape = the largest 4-connected foreground component;
2. colour = the palette entry nearest the median colour of the component's core pixels (None beyond
   ``MAX_COLOUR_DISTANCE``: not a palette colour);
3. size = "large" when the bounding box's longer side is ≥ ``LARGE_EXTENT`` pixels;
4. position = the anchor nearest the bounding-box centre;
5. shape = analysis by synthesis: for each shape, the ideal shape with the component's area and centroid is
   rendered and compared with the component's coverage by soft IoU; the best wins (None below ``MIN_SHAPE_IOU``, or
   when a second component at least ``SECOND_COMPONENT`` times as large exists: not one shape). Coverage is
   estimated per pixel as distance-from-background / distance-of-the-shape-colour-from-background, which undoes the
   anti-aliased blend; a thresholded mask would turn small circles into squares.
An image with no foreground reads as all-None.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from genserve.services.shapes.dataset import COLOURS, IMAGE_SIZE, POSITIONS, SHAPES, coverage

FG_DISTANCE = 60.0
CORE_DISTANCE_FRACTION = 0.7  # core pixels: at least this fraction of the component's largest distance from background
MAX_COLOUR_DISTANCE = 90.0
LARGE_EXTENT = 12
MIN_SHAPE_IOU = 0.6
SECOND_COMPONENT = 0.25
MIN_COMPONENT_PIXELS = 4
ATTRIBUTES = ("shape", "colour", "size", "position")
# A shape with bounding box [-h, h]² has area k·h² and its centroid k'·h below the box centre.
AREA_PER_HALF_EXTENT_SQUARED = {"circle": np.pi, "square": 4.0, "triangle": 2.0, "cross": 20 / 9}
CENTROID_BELOW_CENTRE = {"circle": 0.0, "square": 0.0, "triangle": 1 / 3, "cross": 0.0}

_PALETTE = np.array(list(COLOURS.values()), dtype=np.float32)  # (6, 3)
_ANCHORS = np.array(list(POSITIONS.values()), dtype=np.float32)  # (5, 2) as (x, y)


def _as_hwc_uint8_range(image: np.ndarray | torch.Tensor) -> np.ndarray:
    """Accept uint8 (32, 32, 3) or float (3, 32, 32) in [-1, 1]; return float (32, 32, 3) in [0, 255]."""
    if isinstance(image, torch.Tensor):
        if image.shape != (3, IMAGE_SIZE, IMAGE_SIZE):
            raise ValueError(f"image tensor must be (3, 32, 32) in [-1, 1], got {tuple(image.shape)}")
        return image.detach().float().clamp(-1, 1).add(1).mul(127.5).permute(1, 2, 0).cpu().numpy()
    array = np.asarray(image)
    if array.shape != (IMAGE_SIZE, IMAGE_SIZE, 3) or array.dtype != np.uint8:
        raise ValueError(f"image array must be uint8 (32, 32, 3), got {array.dtype} {array.shape}")
    return array.astype(np.float32)


def _components(mask: np.ndarray) -> list[list[tuple[int, int]]]:
    """4-connected components of a boolean (H, W) mask, largest first."""
    seen = np.zeros_like(mask, dtype=bool)
    height, width = mask.shape
    found = []
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        pixels, queue = [], deque([(y0, x0)])
        while queue:
            y, x = queue.popleft()
            pixels.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < height and 0 <= nx < width and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        found.append(pixels)
    return sorted(found, key=len, reverse=True)


def _coverage_estimate(distance: np.ndarray, ys: np.ndarray, xs: np.ndarray, colour_distance: float) -> np.ndarray:
    """Per-pixel coverage of the component (ys, xs), grown by one pixel to take in its faint anti-aliased rim."""
    region = np.zeros(distance.shape, dtype=bool)
    region[ys, xs] = True
    grown = region.copy()
    grown[1:] |= region[:-1]
    grown[:-1] |= region[1:]
    grown[:, 1:] |= region[:, :-1]
    grown[:, :-1] |= region[:, 1:]
    return np.where(grown, np.clip(distance / max(colour_distance, 1e-6), 0, 1), 0.0)


def _soft_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.minimum(a, b).sum(dim=(-2, -1)) / torch.maximum(a, b).sum(dim=(-2, -1)).clamp_min(1e-6)


def _read_shape(cover: np.ndarray) -> str | None:
    """Analysis by synthesis: fit each shape to the coverage's area and centroid, keep the best soft IoU."""
    area = float(cover.sum())
    if area < MIN_COMPONENT_PIXELS:
        return None
    centres = np.arange(IMAGE_SIZE, dtype=np.float64) + 0.5
    cx = float((cover.sum(axis=0) * centres).sum() / area)
    cy = float((cover.sum(axis=1) * centres).sum() / area)
    scores = {}
    for shape in SHAPES:
        h = (area / AREA_PER_HALF_EXTENT_SQUARED[shape]) ** 0.5
        fitted = coverage(shape, cx, cy - CENTROID_BELOW_CENTRE[shape] * h, h)
        scores[shape] = float(np.minimum(fitted, cover).sum() / np.maximum(fitted, cover).sum())
    best = max(scores, key=scores.get)
    return best if scores[best] >= MIN_SHAPE_IOU else None


def read_attributes(image: np.ndarray | torch.Tensor) -> dict[str, str | None]:
    """Read {shape, colour, size, position} from one image; an attribute that cannot be read is None.

    ``image``: uint8 (32, 32, 3) or float tensor (3, 32, 32) in [-1, 1]. See the module docstring for the rules.
    """
    pixels = _as_hwc_uint8_range(image)
    border = np.concatenate([pixels[0], pixels[-1], pixels[1:-1, 0], pixels[1:-1, -1]])  # (124, 3)
    background = np.median(border, axis=0)
    distance = np.linalg.norm(pixels - background, axis=-1)  # (32, 32)
    components = [c for c in _components(distance > FG_DISTANCE) if len(c) >= MIN_COMPONENT_PIXELS]
    if not components:
        return dict.fromkeys(ATTRIBUTES)
    ys, xs = np.array(components[0]).T
    core = distance[ys, xs] >= CORE_DISTANCE_FRACTION * distance[ys, xs].max()
    median = np.median(pixels[ys[core], xs[core]], axis=0)
    cover = _coverage_estimate(distance, ys, xs, float(np.linalg.norm(median - background)))
    colour_distance = np.linalg.norm(_PALETTE - median, axis=1)
    colour = list(COLOURS)[int(colour_distance.argmin())] if colour_distance.min() <= MAX_COLOUR_DISTANCE else None

    extent = max(ys.max() - ys.min(), xs.max() - xs.min()) + 1
    centre = np.array([(xs.min() + xs.max() + 1) / 2, (ys.min() + ys.max() + 1) / 2], dtype=np.float32)
    position = list(POSITIONS)[int(np.linalg.norm(_ANCHORS - centre, axis=1).argmin())]

    single = len(components) == 1 or len(components[1]) < SECOND_COMPONENT * len(components[0])
    return {
        "shape": _read_shape(cover) if single else None,
        "colour": colour,
        "size": "large" if extent >= LARGE_EXTENT else "small",
        "position": position,
    }


def is_valid(attrs: dict[str, str | None]) -> bool:
    """True when an image read as one valid shape in a palette colour (every attribute readable)."""
    return all(attrs.get(key) is not None for key in ATTRIBUTES)


def read_batch(images: torch.Tensor) -> list[dict[str, str | None]]:
    """``read_attributes`` over a batch (N, 3, 32, 32) in [-1, 1]."""
    return [read_attributes(image) for image in images]


def accuracy(read: list[dict[str, str | None]], expected: list[dict[str, str]]) -> dict[str, float]:
    """Per-attribute fraction of ``read`` equal to ``expected``, plus "all" (all four attributes right)."""
    if len(read) != len(expected) or not read:
        raise ValueError(f"read and expected must be non-empty and equal in length, got {len(read)}, {len(expected)}")
    pairs = list(zip(read, expected, strict=True))
    scores = {key: float(np.mean([r[key] == e[key] for r, e in pairs])) for key in ATTRIBUTES}
    scores["all"] = float(np.mean([all(r[k] == e[k] for k in ATTRIBUTES) for r, e in pairs]))
    return scores
