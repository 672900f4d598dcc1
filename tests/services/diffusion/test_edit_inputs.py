"""An edit's inputs on the wire: the gRPC fields' rules (DiffusionIn), the image and mask checks of
services/diffusion/edit_inputs.py, and the multipart form of POST /v1/images/edits (services/http/images.py), each
bad input named by its field."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
from PIL import Image
from starlette.datastructures import FormData, Headers, UploadFile

from genserve.services.common.errors import InvalidArgument, to_status
from genserve.services.common.validation import parse
from genserve.services.diffusion.edit_inputs import edit_inputs
from genserve.services.diffusion.schema import DiffusionIn
from genserve.services.http import images
from genserve.v1 import diffusion_pb2


def _encoded(size: tuple[int, int], fmt: str = "PNG", mode: str = "RGB", value: int = 200) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, value if mode == "L" else (value, 30, 30)).save(buffer, format=fmt)
    return buffer.getvalue()


def test_image_and_mask_decode_at_the_output_size() -> None:
    image, mask, size = edit_inputs(_encoded((80, 48), "JPEG"), _encoded((80, 48), mode="L", value=255))
    assert size == (48, 80) and image.size == (80, 48) and mask.shape == (1, 1, 48, 80)
    assert float(mask.min()) == 1.0
    image, mask, size = edit_inputs(_encoded((80, 48)), b"", height=64, width=64)  # resized to the request's size
    assert size == (64, 64) and image.size == (64, 64) and mask is None
    pixels = np.asarray(image)
    assert abs(int(pixels[..., 0].mean()) - 200) <= 1


@pytest.mark.parametrize(("image", "mask", "field", "message"), [
    (_encoded((32, 32), "GIF"), b"", "init_image", "must be a PNG or JPEG image, got GIF"),
    (_encoded((32, 32), "BMP"), b"", "init_image", "must be a PNG or JPEG image, got BMP"),
    (b"not an image", b"", "init_image", "is not a PNG or JPEG image"),
    (_encoded((1100, 1000)), b"", "init_image", "over the 1048576-pixel limit"),
    (_encoded((80, 48)), _encoded((48, 80), mode="L"), "mask", "is 48x80, the image is 80x48"),
    (_encoded((80, 48)), _encoded((80, 48), "GIF", mode="L"), "mask", "must be a PNG or JPEG image"),
], ids=["gif", "bmp", "garbage", "too-large", "mask-size", "mask-gif"])
def test_bad_images_name_the_field(image: bytes, mask: bytes, field: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        edit_inputs(image, mask)
    assert info.value.field == field and message in info.value.message


@pytest.mark.parametrize(("fields", "details"), [
    ({"mask": b"x"}, "mask: needs an init_image"),
    ({"strength": 0.5}, "strength: needs an init_image"),
    ({"init_image": b"x", "strength": 0.0}, "strength: Input should be greater than 0"),
    ({"init_image": b"x", "strength": 1.5}, "strength: Input should be less than or equal to 1"),
])
def test_grpc_edit_fields_are_checked_by_name(fields: dict, details: str) -> None:
    with pytest.raises(Exception) as info:
        parse(DiffusionIn, diffusion_pb2.DiffusionRequest(prompt="a cat", **fields))
    assert to_status(info.value, "r").details.startswith(details)


def test_default_strength_is_diffusers() -> None:
    edit = parse(DiffusionIn, diffusion_pb2.DiffusionRequest(prompt="a", init_image=b"x"))
    inpaint = parse(DiffusionIn, diffusion_pb2.DiffusionRequest(prompt="a", init_image=b"x", mask=b"y"))
    assert (edit.edit_strength, inpaint.edit_strength) == (0.8, 1.0)


def _form(**items) -> FormData:
    def upload(name: str, data: bytes) -> UploadFile:
        return UploadFile(io.BytesIO(data), filename=f"{name}.png", headers=Headers({"content-type": "image/png"}))

    return FormData([(k, upload(k, v) if isinstance(v, bytes) else v) for k, v in items.items()])


def test_edit_form_becomes_the_diffusion_request() -> None:
    png, mask = _encoded((80, 48)), _encoded((80, 48), mode="L")
    request = asyncio.run(images.edit_request(_form(image=png, mask=mask, prompt="a red circle", n="2",
                                                    size="80x48", strength="0.6", seed="7")))
    assert (request.init_image, request.mask, request.prompt, request.num_images) == (png, mask, "a red circle", 2)
    assert (request.width, request.height, request.seed) == (80, 48, 7)
    assert request.strength == pytest.approx(0.6)


@pytest.mark.parametrize(("items", "field"), [
    ({"prompt": "x"}, "image"),
    ({"image": b"png", "prompt": "x", "response_format": "url"}, "response_format"),
    ({"image": b"png", "prompt": "x", "size": "big"}, "size"),
    ({"image": b"png", "prompt": "x", "n": "two"}, "n"),
    ({"image": b"png", "prompt": "x", "model": "dall-e-2"}, "model"),
    ({"image": b"png", "prompt": "x", "n": "9"}, "num_images"),
])
def test_bad_edit_forms_name_the_field(items: dict, field: str) -> None:
    with pytest.raises(Exception) as info:
        asyncio.run(images.edit_request(_form(**items)))
    exc = info.value
    named = exc.field if isinstance(exc, InvalidArgument) else exc.errors()[0]["loc"][0]
    assert named == field
