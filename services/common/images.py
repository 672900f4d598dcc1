"""Images on the wire: tensors in [-1, 1] <-> PNG bytes, and latents <-> the Tensor message."""

from __future__ import annotations

import io

import numpy as np
import torch
from genserve.v1 import common_pb2
from PIL import Image as PILImage

from .errors import InvalidArgument

# A decoded image larger than this is refused before PIL allocates it (decompression bombs).
MAX_PIXELS = 1024 * 1024


def to_png(image: torch.Tensor) -> bytes:
    """One (3, H, W) image in [-1, 1] as PNG bytes."""
    pixels = ((image.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # (3, H, W)
    array = pixels.permute(1, 2, 0).cpu().numpy()  # (H, W, 3)
    buffer = io.BytesIO()
    PILImage.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def from_png(data: bytes, size: int, field: str) -> torch.Tensor:
    """PNG (or any PIL-readable) bytes as a (3, size, size) tensor in [-1, 1]; raises InvalidArgument on bad input."""
    if not data:
        raise InvalidArgument(field, "is empty; expected PNG bytes")
    try:
        with PILImage.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_PIXELS:
                raise InvalidArgument(field, f"image is {img.width}x{img.height}, too large")
            rgb = img.convert("RGB")
    except InvalidArgument:
        raise
    except Exception as exc:  # PIL raises many types for corrupt data; all mean the same to the client.
        raise InvalidArgument(field, "is not a readable image") from exc
    if rgb.size != (size, size):
        raise InvalidArgument(field, f"image is {rgb.width}x{rgb.height}, expected {size}x{size}")
    array = np.asarray(rgb, dtype=np.float32)  # (H, W, 3)
    return torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1  # (3, H, W)


def image_messages(images: torch.Tensor) -> list[common_pb2.Image]:
    """A (N, 3, H, W) batch in [-1, 1] as Image messages."""
    n, _, height, width = images.shape
    return [common_pb2.Image(png=to_png(images[i]), width=width, height=height) for i in range(n)]


def images_response(images: torch.Tensor, seed: int) -> common_pb2.ImagesResponse:
    return common_pb2.ImagesResponse(images=image_messages(images), seed=seed)


def tensor_message(tensor: torch.Tensor) -> common_pb2.Tensor:
    flat = tensor.detach().float().cpu().reshape(-1)
    return common_pb2.Tensor(shape=list(tensor.shape), values=flat.tolist())


def tensor_from_message(shape: list[int], values: list[float]) -> torch.Tensor:
    """The tensor a (validated) Tensor message describes."""
    return torch.tensor(values, dtype=torch.float32).reshape(shape)
