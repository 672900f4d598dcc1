"""A Stable-Diffusion-format folder served end to end: GENSERVE_DIFFUSION_MODEL=DIR makes `diffusion` serve it and
`vae` serve its vae/; a seeded Generate returns diffusers' StableDiffusionPipeline image within 2/255, and a bad
size is INVALID_ARGUMENT naming the field. Edits too: a seeded image-to-image Generate (init_image, strength) is
diffusers' StableDiffusionImg2ImgPipeline image, and the official openai client's images.edit (multipart, with a
mask) is StableDiffusionInpaintPipeline's. On the session's models_stack (tests/e2e/conftest.py), which serves the
folder of the sd_folder fixture.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from genserve.services.client import Client, GenserveError

pytestmark = pytest.mark.e2e
PROMPT = "An astronaut riding a horse, oil painting"


@pytest.fixture(scope="module")
def sd_client(models_stack) -> Iterator[Client]:
    with Client(models_stack.address, timeout=120) as client:
        yield client


def _pixels(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as img:
        return np.asarray(img.convert("RGB"), dtype=np.int16)


def test_generate_returns_the_diffusers_image_for_the_seed(sd_folder: Path, sd_client: Client) -> None:
    from diffusers import StableDiffusionPipeline

    ref = StableDiffusionPipeline.from_pretrained(sd_folder, safety_checker=None, requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    expected = ref(PROMPT, num_inference_steps=4, guidance_scale=7.5, height=48, width=80, num_images_per_prompt=2,
                   generator=torch.Generator("cpu").manual_seed(7), output_type="np").images
    reply = sd_client.diffuse(PROMPT, steps=4, guidance_scale=7.5, seed=7, num_images=2, width=80, height=48)
    assert reply.seed == 7 and [(i.width, i.height) for i in reply.images] == [(80, 48), (80, 48)]
    for image, theirs in zip(reply.images, expected, strict=True):
        assert np.abs(_pixels(image.png) - np.round(theirs * 255)).max() <= 2


def test_bad_size_is_invalid_argument_naming_the_field(sd_client: Client) -> None:
    with pytest.raises(GenserveError) as info:
        sd_client.diffuse(PROMPT, steps=1, width=100)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "width" in info.value.details


def test_the_vae_app_serves_the_folders_autoencoder(sd_client: Client) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (80, 48), (200, 30, 30)).save(buffer, format="PNG")
    encoded = sd_client.vae_encode([buffer.getvalue()])
    assert list(encoded.latents.shape) == [1, 4, 6, 10]
    assert encoded.scaling_factor == pytest.approx(0.18215)


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def edit_inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    pixels = np.clip(rng.normal(128, 60, (48, 80, 3)), 0, 255).astype(np.uint8)
    mask = np.zeros((48, 80), np.uint8)
    mask[10:40, 20:60] = 255
    return pixels, mask


def test_img2img_over_grpc_is_the_diffusers_image(sd_folder: Path, models_stack, edit_inputs) -> None:
    from diffusers import StableDiffusionImg2ImgPipeline

    from genserve.v1 import diffusion_pb2, diffusion_pb2_grpc

    pixels, _ = edit_inputs
    ref = StableDiffusionImg2ImgPipeline.from_pretrained(sd_folder, safety_checker=None,
                                                         requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    expected = ref(PROMPT, image=Image.fromarray(pixels), strength=0.6, num_inference_steps=4, guidance_scale=7.5,
                   generator=torch.Generator("cpu").manual_seed(5), output_type="np").images
    request = diffusion_pb2.DiffusionRequest(prompt=PROMPT, init_image=_png(pixels), strength=0.6, steps=4,
                                             guidance_scale=7.5, seed=5)
    with grpc.insecure_channel(models_stack.address) as channel:
        reply = diffusion_pb2_grpc.DiffusionStub(channel).Generate(request, metadata=(("application", "diffusion"),),
                                                                   timeout=120)
    assert [(i.width, i.height) for i in reply.images] == [(80, 48)]  # the image's own size
    assert np.abs(_pixels(reply.images[0].png) - np.round(expected[0] * 255)).max() <= 2
    with grpc.insecure_channel(models_stack.address) as channel, pytest.raises(grpc.RpcError) as info:
        bad = diffusion_pb2.DiffusionRequest(prompt=PROMPT, init_image=_png(pixels), mask=_png(pixels[:, :40]))
        diffusion_pb2_grpc.DiffusionStub(channel).Generate(bad, metadata=(("application", "diffusion"),), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("mask: ")


def test_openai_images_edit_is_the_diffusers_inpainting(sd_folder: Path, models_stack, edit_inputs) -> None:
    import base64

    import openai
    from diffusers import StableDiffusionInpaintPipeline

    pixels, mask = edit_inputs
    ref = StableDiffusionInpaintPipeline.from_pretrained(sd_folder, safety_checker=None,
                                                         requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    expected = ref(PROMPT, image=Image.fromarray(pixels), mask_image=Image.fromarray(mask), num_inference_steps=4,
                   guidance_scale=7.5, height=48, width=80, generator=torch.Generator("cpu").manual_seed(9),
                   output_type="np").images
    with openai.OpenAI(base_url=models_stack.http_url, api_key="unused", max_retries=0, timeout=120) as api:
        reply = api.images.edit(image=("image.png", _png(pixels), "image/png"), mask=("mask.png", _png(mask),
                                "image/png"), prompt=PROMPT, n=1, size="80x48", response_format="b64_json",
                                extra_body={"seed": 9, "steps": 4, "guidance_scale": 7.5})
        assert len(reply.data) == 1
        assert np.abs(_pixels(base64.b64decode(reply.data[0].b64_json)) - np.round(expected[0] * 255)).max() <= 2
        with pytest.raises(openai.BadRequestError) as info:
            api.images.edit(image=("image.gif", b"GIF89a", "image/gif"), prompt=PROMPT)
        assert info.value.body["param"] == "image"
