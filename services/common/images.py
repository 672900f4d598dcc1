"""Images on the wire: tensors in [-1, 1] <-> PNG bytes, and latents <-> the Tensor message (raw bytes with dtype
and shape: one copy each way, and validation is a few vectorised checks, not one per value)."""

from __future__ import annotations

import io
import math

import numpy as np
import torch
from PIL import Image as PILImage

from genserve.v1 import common_pb2

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


def from_png(data: bytes, size: int | None, field: str, multiple_of: int = 1) -> torch.Tensor:
    """PNG (or any PIL-readable) bytes as a (3, H, W) tensor in [-1, 1]: exactly size × size, or (``size`` None) any
    size whose sides are multiples of ``multiple_of``; raises InvalidArgument on bad input."""
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
    if size is not None and rgb.size != (size, size):
        raise InvalidArgument(field, f"image is {rgb.width}x{rgb.height}, expected {size}x{size}")
    if rgb.width % multiple_of or rgb.height % multiple_of:
        raise InvalidArgument(field, f"image is {rgb.width}x{rgb.height}; sides must be multiples of {multiple_of}")
    array = np.asarray(rgb, dtype=np.float32)  # (H, W, 3)
    return torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1  # (3, H, W)


def image_messages(images: torch.Tensor) -> list[common_pb2.Image]:
    """A (N, 3, H, W) batch in [-1, 1] as Image messages."""
    n, _, height, width = images.shape
    return [common_pb2.Image(png=to_png(images[i]), width=width, height=height) for i in range(n)]


def images_response(images: torch.Tensor, seed: int) -> common_pb2.ImagesResponse:
    return common_pb2.ImagesResponse(images=image_messages(images), seed=seed)


TENSOR_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def tensor_message(tensor: torch.Tensor) -> common_pb2.Tensor:
    """A tensor as its raw little-endian bytes (float32/float16/bfloat16 kept; other dtypes become float32)."""
    name = next((n for n, d in TENSOR_DTYPES.items() if d == tensor.dtype), "float32")
    flat = tensor.detach().to("cpu", TENSOR_DTYPES[name]).contiguous().reshape(-1)
    # torch's memory order is the host's; genserve runs on little-endian hosts (x86-64, ARM64) only.
    return common_pb2.Tensor(shape=list(tensor.shape), dtype=name, data=flat.view(torch.uint8).numpy().tobytes())


def tensor_from_message(message: common_pb2.Tensor, field: str) -> torch.Tensor:
    """The float32 tensor a Tensor message holds; InvalidArgument naming ``field``.shape/.dtype/.data otherwise."""
    name = message.dtype or "float32"
    if name not in TENSOR_DTYPES:
        raise InvalidArgument(f"{field}.dtype", f"must be one of {', '.join(TENSOR_DTYPES)}, got {name!r}")
    shape = list(message.shape)
    if not shape or any(d <= 0 for d in shape):
        raise InvalidArgument(f"{field}.shape", f"must be positive sizes, got {shape}")
    dtype = TENSOR_DTYPES[name]
    expected = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if len(message.data) != expected:
        raise InvalidArgument(f"{field}.data", f"holds {len(message.data)} bytes; shape {shape} of {name} needs "
                                               f"{expected}")
    tensor = torch.frombuffer(bytearray(message.data), dtype=dtype).reshape(shape).float()
    if not torch.isfinite(tensor).all():
        raise InvalidArgument(f"{field}.data", "values must be finite")
    return tensor
