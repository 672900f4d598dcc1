"""PNG encoding on the wire: exact round trip at 8-bit precision, and clear errors for bad bytes."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from genserve.services.common.errors import InvalidArgument
from genserve.services.common.images import from_png, image_messages, tensor_from_message, tensor_message, to_png
from genserve.v1 import common_pb2


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tensor_message_round_trip_in_each_dtype(dtype: torch.dtype) -> None:
    tensor = torch.randn(2, 4, 8, 8).to(dtype)
    message = tensor_message(tensor)
    assert list(message.shape) == [2, 4, 8, 8]
    assert message.dtype == str(dtype).removeprefix("torch.")
    assert len(message.data) == tensor.numel() * tensor.element_size()  # raw bytes, no per-value framing
    back = tensor_from_message(message, "latents")
    assert back.dtype == torch.float32
    torch.testing.assert_close(back, tensor.float(), rtol=0, atol=0)


def test_client_float32_tensor_is_what_the_server_reads() -> None:
    from genserve.services.client.requests import float32_tensor, tensor_values

    values = [0.5, -1.25, 3.0, 1e-3, 7.0, -2.0]
    message = float32_tensor([1, 2, 3], values)
    torch.testing.assert_close(tensor_from_message(message, "latents"), torch.tensor(values).reshape(1, 2, 3))
    assert tensor_values(message) == pytest.approx(values)
    for dtype in (torch.float16, torch.bfloat16):
        assert tensor_values(tensor_message(torch.tensor(values).to(dtype))) == pytest.approx(values, rel=1e-2)


@pytest.mark.parametrize(("change", "field", "message"), [
    (dict(dtype="int8"), "latents.dtype", "must be one of"),
    (dict(shape=[2, 0, 3]), "latents.shape", "positive"),
    (dict(data=b"\0" * 10), "latents.data", "holds 10 bytes"),
    (dict(data=torch.tensor([1.0, float("nan"), 0.0, 0.0, 0.0, 0.0]).numpy().tobytes()), "latents.data", "finite"),
])
def test_bad_tensor_messages_name_the_field(change: dict, field: str, message: str) -> None:
    good = tensor_message(torch.zeros(1, 2, 3))
    bad = common_pb2.Tensor(shape=change.get("shape", list(good.shape)), dtype=change.get("dtype", good.dtype),
                            data=change.get("data", good.data))
    with pytest.raises(InvalidArgument, match=message) as info:
        tensor_from_message(bad, "latents")
    assert info.value.field == field


def test_any_size_png_must_be_a_multiple_of_the_factor() -> None:
    image = torch.rand(3, 16, 24) * 2 - 1
    assert from_png(to_png(image), None, "x", 8).shape == (3, 16, 24)
    with pytest.raises(InvalidArgument, match="multiples of 16"):
        from_png(to_png(image), None, "x", 16)
