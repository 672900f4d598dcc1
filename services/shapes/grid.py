"""Sample grids: tile (N, 3, 32, 32) images in [-1, 1] into one PNG, for training logs and the docs."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from PIL import Image

from genserve.services.shapes.dataset import to_uint8


def image_grid(images: torch.Tensor, n_cols: int | None = None, scale: int = 2, pad: int = 2) -> Image.Image:
    """Tile images row by row (white gutters of ``pad`` pixels), each enlarged ``scale``× by nearest neighbour."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (N, 3, H, W), got {tuple(images.shape)}")
    n = images.shape[0]
    n_cols = n_cols or math.ceil(math.sqrt(n))
    n_rows = math.ceil(n / n_cols)
    pixels = to_uint8(images)  # (N, H, W, 3)
    height, width = pixels.shape[1] * scale, pixels.shape[2] * scale
    canvas = Image.new("RGB", (n_cols * (width + pad) + pad, n_rows * (height + pad) + pad), (255, 255, 255))
    for i, tile in enumerate(pixels):
        row, col = divmod(i, n_cols)
        image = Image.fromarray(tile).resize((width, height), Image.NEAREST)
        canvas.paste(image, (pad + col * (width + pad), pad + row * (height + pad)))
    return canvas


def save_grid(images: torch.Tensor, path: str | Path, n_cols: int | None = None, scale: int = 2) -> Path:
    """Write ``image_grid(images)`` as a PNG, creating parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, n_cols=n_cols, scale=scale).save(out)
    return out
