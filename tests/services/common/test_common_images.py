"""PNG encoding on the wire: exact round trip at 8-bit precision, and clear errors for bad bytes."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from services.common.errors import InvalidArgument
from services.common.images import from_png, image_messages, tensor_from_message, tensor_message, to_png


def test_png_round_trip_within_one_quantisation_step() -> None:
    image = torch.rand(3, 32, 32) * 2 - 1
    back = from_png(to_png(image), 32, "images[0].png")
    assert back.shape == (3, 32, 32)
    torch.testing.assert_close(back, image, atol=1 / 127.5, rtol=0)


def test_values_outside_the_range_are_clipped() -> None:
    image = torch.full((3, 4, 4), 3.0)
    assert from_png(to_png(image), 4, "x").eq(1.0).all()


def test_image_messages_carry_the_size() -> None:
    messages = image_messages(torch.zeros(2, 3, 8, 16))
    assert [(m.width, m.height) for m in messages] == [(16, 8), (16, 8)]
    with Image.open(io.BytesIO(messages[0].png)) as img:
        assert img.format == "PNG" and img.size == (16, 8)


@pytest.mark.parametrize(
    ("data", "message"),
    [(b"", "is empty"), (b"\x89PNG but not really", "not a readable image"), (b"GIF89a", "not a readable image")],
)
def test_bad_bytes_name_the_field(data: bytes, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as info:
        from_png(data, 32, "images[2].png")
    assert info.value.field == "images[2].png"


def test_wrong_size_is_refused() -> None:
    buffer = io.BytesIO()
    Image.new("L", (16, 16)).save(buffer, format="PNG")
    with pytest.raises(InvalidArgument, match="16x16, expected 32x32"):
        from_png(buffer.getvalue(), 32, "images[0].png")


def test_grayscale_is_converted_to_rgb() -> None:
    buffer = io.BytesIO()
    Image.new("L", (32, 32), 255).save(buffer, format="PNG")
    assert from_png(buffer.getvalue(), 32, "x").eq(1.0).all()


def test_tensor_message_round_trip() -> None:
    tensor = torch.randn(2, 4, 8, 8)
    message = tensor_message(tensor)
    assert list(message.shape) == [2, 4, 8, 8]
    torch.testing.assert_close(tensor_from_message(list(message.shape), list(message.values)), tensor)
