"""An edit request's image and mask as the pipeline takes them: PNG or JPEG bytes checked and decoded, the image
resized to the output size (Lanczos, as diffusers' VaeImageProcessor), the mask checked against the image's size and
turned into a single channel in [0, 1]. Every refusal names its field (``init_image`` or ``mask``)."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image as PILImage

from genserve.services.common.errors import InvalidArgument

FORMATS = ("PNG", "JPEG")
MAX_EDIT_PIXELS = 1024 * 1024  # a larger image is refused before it is decoded (decompression bombs)


def open_image(data: bytes, field: str) -> PILImage.Image:
    """The decoded image, or InvalidArgument naming ``field``: empty, not a PNG or JPEG, unreadable, too large."""
    if not data:
        raise InvalidArgument(field, "is empty; expected a PNG or JPEG image")
    try:
        img = PILImage.open(io.BytesIO(data))
    except Exception as exc:  # PIL raises many types for corrupt data; all mean the same to the client
        raise InvalidArgument(field, "is not a PNG or JPEG image") from exc
    if img.format not in FORMATS:
        raise InvalidArgument(field, f"must be a PNG or JPEG image, got {img.format or 'an unknown format'}")
    if img.width * img.height > MAX_EDIT_PIXELS:
        raise InvalidArgument(field, f"image is {img.width}x{img.height}, over the {MAX_EDIT_PIXELS}-pixel limit")
    try:
        img.load()
    except Exception as exc:
        raise InvalidArgument(field, "is not a readable image") from exc
    return img


def edit_inputs(image: bytes, mask: bytes, height: int | None = None, width: int | None = None
                ) -> tuple[PILImage.Image, torch.Tensor | None, tuple[int, int]]:
    """(the RGB image at the output size, the mask (1, 1, H, W) in [0, 1] or None, (height, width)); a side left
    None is the image's own."""
    img = open_image(image, "init_image").convert("RGB")
    height, width = height or img.height, width or img.width
    mask_tensor = None
    if mask:
        m = open_image(mask, "mask")
        if m.size != img.size:
            raise InvalidArgument("mask", f"is {m.width}x{m.height}, the image is {img.width}x{img.height}")
        m = m.convert("L")
        if m.size != (width, height):
            m = m.resize((width, height), PILImage.Resampling.LANCZOS)
        mask_tensor = torch.from_numpy(np.asarray(m, dtype=np.float32) / 255.0)[None, None]
    if img.size != (width, height):
        img = img.resize((width, height), PILImage.Resampling.LANCZOS)
    return img, mask_tensor, (height, width)


def png_bytes(img: PILImage.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def masked_image(image: PILImage.Image, mask: torch.Tensor) -> PILImage.Image:
    """The image with the mask's region (>= 0.5) set to the middle of the range, as diffusers' inpainting pipeline
    multiplies the [-1, 1] image by (mask < 0.5): 0 there is grey 127.5, here 128 (PNG holds whole values)."""
    keep = (mask[0, 0] < 0.5).numpy()[..., None]  # (H, W, 1)
    pixels = np.where(keep, np.asarray(image), 128).astype(np.uint8)
    return PILImage.fromarray(pixels)
