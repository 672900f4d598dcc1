"""Image-to-image and inpainting in our pipeline, seed for seed against diffusers' StableDiffusionImg2ImgPipeline,
StableDiffusionInpaintPipeline and StableDiffusion3Img2ImgPipeline on tiny random folders (within 2/255 per pixel,
fp32, CPU, non-square), and the bad inputs named by their field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from genserve.services.diffusion.edits import Posterior, start_index
from genserve.services.diffusion.pipeline import DiffusionPipeline
from genserve.shared.blocks.autoencoder_kl import load_autoencoder_kl
from genserve.shared.blocks.autoencoder_kl_flow import load_flow_autoencoder_kl
from tests.services.diffusion.tiny_sd import build_tiny_sd
from tests.services.diffusion.tiny_sd3 import build_tiny_sd3

PROMPT = "An astronaut riding a horse, oil painting"
H, W = 48, 80


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("edits")
    return {"sd": build_tiny_sd(root / "sd", latent=8), "sd3": build_tiny_sd3(root / "sd3", latent=8)}


@pytest.fixture(scope="module")
def image() -> tuple[np.ndarray, np.ndarray]:
    """A noisy RGB image (H, W, 3) and a mask (H, W) with a white (repaint) rectangle."""
    rng = np.random.default_rng(0)
    pixels = np.clip(rng.normal(128, 60, (H, W, 3)), 0, 255).astype(np.uint8)
    mask = np.zeros((H, W), np.uint8)
    mask[10:40, 20:60] = 255
    return pixels, mask


def _ours(folder: Path, pixels: np.ndarray, flow: bool, **settings) -> np.ndarray:
    vae = load_flow_autoencoder_kl(folder / "vae")[0] if flow else load_autoencoder_kl(folder / "vae")
    x = torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 127.5 - 1
    with torch.no_grad():
        posterior = Posterior(*vae.encode(x))
        latents = DiffusionPipeline.from_dir(folder).generate([PROMPT] * 2, steps=4, seed=3, height=H, width=W,
                                                              init=posterior, **settings)
        images = vae.decode(latents)
    return ((images.clamp(-1, 1) + 1) * 127.5).round().permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize(("sampler", "strength"), [("euler", 0.75)])  # DDIM: the app test below
def test_img2img_matches_stable_diffusion_img2img(folders, image, sampler: str, strength: float) -> None:
    from diffusers import DDIMScheduler, EulerDiscreteScheduler, StableDiffusionImg2ImgPipeline

    ref = StableDiffusionImg2ImgPipeline.from_pretrained(folders["sd"], safety_checker=None,
                                                         requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    cls = {"ddim": DDIMScheduler, "euler": EulerDiscreteScheduler}[sampler]
    ref.scheduler = cls.from_config(ref.scheduler.config)
    pixels, _ = image
    expected = ref(PROMPT, image=Image.fromarray(pixels), strength=strength, num_inference_steps=4,
                   guidance_scale=7.5, num_images_per_prompt=2, generator=torch.Generator("cpu").manual_seed(3),
                   output_type="np").images
    ours = _ours(folders["sd"], pixels, False, strength=strength, scheduler=sampler, guidance_scale=7.5)
    assert np.abs(ours - np.round(expected * 255)).max() <= 2


@pytest.mark.parametrize("strength", [0.75])  # strength 1: the 9-channel test
def test_inpainting_matches_stable_diffusion_inpaint(folders, image, strength: float) -> None:
    from diffusers import StableDiffusionInpaintPipeline

    ref = StableDiffusionInpaintPipeline.from_pretrained(folders["sd"], safety_checker=None,
                                                         requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    pixels, mask = image
    expected = ref(PROMPT, image=Image.fromarray(pixels), mask_image=Image.fromarray(mask), strength=strength,
                   num_inference_steps=4, guidance_scale=7.5, height=H, width=W, num_images_per_prompt=2,
                   generator=torch.Generator("cpu").manual_seed(3), output_type="np").images
    ours = _ours(folders["sd"], pixels, False, strength=strength, guidance_scale=7.5,
                 mask=torch.from_numpy(mask).float()[None, None] / 255)
    assert np.abs(ours - np.round(expected * 255)).max() <= 2
    keep = mask == 0  # outside the mask the image's own latents were kept: far closer to the input than inside
    assert np.abs(ours[0][keep] - pixels[keep]).mean() < np.abs(ours[0][~keep] - pixels[~keep]).mean()


def test_sd3_img2img_matches_stable_diffusion_3_img2img(folders, image) -> None:
    from diffusers import StableDiffusion3Img2ImgPipeline

    ref = StableDiffusion3Img2ImgPipeline.from_pretrained(folders["sd3"])
    ref.set_progress_bar_config(disable=True)
    pixels, _ = image
    expected = ref(PROMPT, image=Image.fromarray(pixels), strength=0.6, num_inference_steps=4, guidance_scale=5.0,
                   height=H, width=W,
                   num_images_per_prompt=2, generator=torch.Generator("cpu").manual_seed(3), output_type="np").images
    ours = _ours(folders["sd3"], pixels, True, strength=0.6, guidance_scale=5.0)
    assert np.abs(ours - np.round(expected * 255)).max() <= 2


def test_start_index_follows_each_pipeline_family() -> None:
    assert [start_index(4, s, flow=False) for s in (1.0, 0.6, 0.5, 0.2)] == [0, 2, 2, 4]
    assert [start_index(4, s, flow=True) for s in (1.0, 0.6, 0.5, 0.2)] == [0, 1, 2, 3]


@pytest.mark.parametrize(("settings", "message"), [
    ({"strength": 0.0}, "strength must be in"),
    ({"strength": 1.5}, "strength must be in"),
    ({"mask": torch.ones(1, 1, H, 40)}, "^mask: expected"),
    ({"init": Posterior(torch.zeros(1, 4, 5, 10), torch.zeros(1, 4, 5, 10))}, "^init_image: expected"),
])
def test_bad_edits_name_the_field(folders, settings: dict, message: str) -> None:
    pipe = DiffusionPipeline.from_dir(folders["sd"])
    settings = {"init": Posterior(torch.zeros(1, 4, 6, 10), torch.zeros(1, 4, 6, 10)), **settings}
    with pytest.raises(ValueError, match=message):
        pipe.generate(["a cat"], steps=2, height=H, width=W, **settings)
    with pytest.raises(ValueError, match="^mask: inpainting needs an init_image"):
        pipe.generate(["a cat"], steps=2, height=H, width=W, mask=torch.ones(1, 1, H, W))


@pytest.mark.parametrize("strength", [1.0])  # strength 1: no image sample is drawn (diffusers' order)
def test_nine_channel_inpainting_unet_matches_diffusers(tmp_path: Path, image, strength: float) -> None:
    """A folder whose U-Net takes 9 channels reads the mask and the masked image's latents every step."""
    from diffusers import StableDiffusionInpaintPipeline

    folder = build_tiny_sd(tmp_path / "inpaint", latent=8, inpainting=True)
    ref = StableDiffusionInpaintPipeline.from_pretrained(folder, safety_checker=None, requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    pixels, mask = image
    expected = ref(PROMPT, image=Image.fromarray(pixels), mask_image=Image.fromarray(mask), strength=strength,
                   num_inference_steps=3, guidance_scale=7.5, height=H, width=W,
                   generator=torch.Generator("cpu").manual_seed(3), output_type="np").images
    vae = load_autoencoder_kl(folder / "vae")
    x = torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 127.5 - 1
    pixel_mask = torch.from_numpy(mask).float()[None, None] / 255
    pipe = DiffusionPipeline.from_dir(folder)
    assert pipe.model.inpainting_unet
    with torch.no_grad():
        init, masked = Posterior(*vae.encode(x)), Posterior(*vae.encode(x * (pixel_mask < 0.5)))
        latents = pipe.generate([PROMPT], steps=3, seed=3, height=H, width=W, guidance_scale=7.5, init=init,
                                strength=strength, mask=pixel_mask, masked=masked)
        ours = ((vae.decode(latents).clamp(-1, 1) + 1) * 127.5).round().permute(0, 2, 3, 1).numpy()
        with pytest.raises(ValueError, match="^mask: this is an inpainting model"):
            pipe.generate([PROMPT], steps=1, height=H, width=W)
    assert np.abs(ours - np.round(expected * 255)).max() <= 2


def test_demo_model_inpainting_keeps_the_unmasked_latents(tiny_pipe) -> None:
    """On the demo model's pipeline: after the last step the latents outside the mask are the image's own."""
    c, h, w = tiny_pipe.latent_shape
    height, width = tiny_pipe.model.native_size
    torch.manual_seed(0)
    mean = torch.randn(1, c, h, w)
    init = Posterior(mean, torch.full_like(mean, -30.0))  # σ = e^-15: the sample is the mean
    mask = torch.zeros(1, 1, height, width)
    mask[..., : height // 2, :] = 1.0  # repaint the top half
    latents = tiny_pipe.generate(["a red circle"], steps=4, seed=0, init=init, strength=0.5, mask=mask)
    keep = torch.zeros(1, 1, h, w, dtype=torch.bool)
    keep[..., h // 2 :, :] = True
    torch.testing.assert_close(latents[keep.expand_as(latents)], mean[keep.expand_as(mean)], rtol=0, atol=1e-4)
    assert (latents - mean)[~keep.expand_as(latents)].abs().mean() > 0.05  # the top half was generated


def test_the_diffusion_app_edits_through_the_vae_app(folders, image) -> None:
    """The gRPC handler in-process (its vae handle replaced by our VAE): an init_image request encodes the image
    through the vae app's Encode and returns diffusers' image-to-image result for the seed, at the image's size."""
    import asyncio
    import io

    from diffusers import StableDiffusionImg2ImgPipeline

    from genserve.services.common.images import images_response, tensor_from_message, tensor_message
    from genserve.services.diffusion.app import Diffusion
    from genserve.v1 import diffusion_pb2, vae_pb2

    vae = load_autoencoder_kl(folders["sd"] / "vae")

    def encode(request: vae_pb2.EncodeRequest) -> vae_pb2.EncodeResponse:
        pixels = np.asarray(Image.open(io.BytesIO(request.images[0].png)).convert("RGB"), dtype=np.float32)
        with torch.no_grad():
            mean, logvar = vae.encode(torch.from_numpy(pixels).permute(2, 0, 1)[None] / 127.5 - 1)
        return vae_pb2.EncodeResponse(mean=tensor_message(mean), logvar=tensor_message(logvar))

    def decode(request: vae_pb2.DecodeRequest):
        with torch.no_grad():
            return images_response(vae.decode(tensor_from_message(request.latents, "latents")), 0)

    class Call:
        def __init__(self, fn) -> None:
            self.fn = fn

        async def remote(self, request):
            return self.fn(request)

    class VaeHandle:
        Encode, Decode = Call(encode), Call(decode)

    app = Diffusion.func_or_class(str(folders["sd"]), None)
    app._vae = VaeHandle()
    pixels, _ = image
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    request = diffusion_pb2.DiffusionRequest(prompt=PROMPT, init_image=buffer.getvalue(), strength=0.6, steps=4,
                                             guidance_scale=7.5, seed=5)
    reply = asyncio.run(app.Generate(request))
    assert [(i.width, i.height) for i in reply.images] == [(W, H)]
    ref = StableDiffusionImg2ImgPipeline.from_pretrained(folders["sd"], safety_checker=None,
                                                         requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    expected = ref(PROMPT, image=Image.fromarray(pixels), strength=0.6, num_inference_steps=4, guidance_scale=7.5,
                   generator=torch.Generator("cpu").manual_seed(5), output_type="np").images
    ours = np.asarray(Image.open(io.BytesIO(reply.images[0].png)).convert("RGB"), dtype=np.int16)
    assert np.abs(ours - np.round(expected[0] * 255)).max() <= 2
