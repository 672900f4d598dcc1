"""A Flux-format diffusers folder in our pipeline: the 3-axis RoPE, the transformer's velocity against
FluxTransformer2DModel, and images seed for seed against FluxPipeline (within 2/255 per pixel, fp32, CPU, the
guidance embedding, dynamic shifting, non-square), with the refusals named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from genserve.services.diffusion.flux import load_flux, pack, unpack
from genserve.services.diffusion.flux_folder import load_flux_components
from genserve.services.diffusion.pipeline import DiffusionPipeline
from genserve.services.diffusion.text_conditioning import TextConditioning
from genserve.shared.blocks.autoencoder_kl_flow import load_flow_autoencoder_kl
from genserve.shared.blocks.rope_axes import axes_rotary, image_ids
from tests.services.diffusion.tiny_flux import FLUX_SHIFT, build_tiny_flux

PROMPT = "An astronaut riding a horse, oil painting"


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_flux(tmp_path_factory.mktemp("flux") / "pipeline", latent=8)


def test_rope_and_packing_match_diffusers() -> None:
    from diffusers.models.embeddings import FluxPosEmbed
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    ids = torch.cat([torch.zeros(5, 3), FluxPipeline._prepare_latent_image_ids(1, 3, 4, "cpu", torch.float32)])
    assert torch.equal(image_ids(3, 4), ids[5:])
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=[4, 6, 6])(ids)
    ours = axes_rotary(ids, (4, 6, 6))
    torch.testing.assert_close(ours[0], cos, rtol=0, atol=0)
    torch.testing.assert_close(ours[1], sin, rtol=0, atol=0)
    latents = torch.randn(2, 16, 6, 8)
    assert torch.equal(pack(latents), FluxPipeline._pack_latents(latents, 2, 16, 6, 8))
    assert torch.equal(unpack(pack(latents), 6, 8), latents)


def test_velocity_matches_flux_transformer(flux_dir: Path) -> None:
    from diffusers import FluxTransformer2DModel
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    ref = FluxTransformer2DModel.from_pretrained(flux_dir / "transformer").eval()
    torch.manual_seed(0)
    x, ctx, pooled = torch.randn(2, 16, 6, 10), torch.randn(2, 20, 48), torch.randn(2, 32)
    t, g = torch.tensor([981.0, 3.0]), torch.tensor([3.5, 1.0])
    with torch.no_grad():
        expected = ref(hidden_states=pack(x), timestep=t / 1000, guidance=g, pooled_projections=pooled,
                       encoder_hidden_states=ctx, txt_ids=torch.zeros(20, 3),
                       img_ids=FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32)).sample
        ours = load_flux(flux_dir / "transformer")(x, t, TextConditioning(ctx, pooled, g))
    assert expected.abs().mean() > 0.1
    torch.testing.assert_close(ours, unpack(expected, 6, 10), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n", "height", "width", "scale"), [(2, 48, 80, 3.5), (1, 64, 32, 1.0)])
def test_images_match_flux_pipeline_seed_for_seed(flux_dir: Path, n: int, height: int, width: int,
                                                  scale: float) -> None:
    from diffusers import FluxPipeline

    ref = FluxPipeline.from_pretrained(flux_dir)
    ref.set_progress_bar_config(disable=True)
    expected = ref(PROMPT, num_inference_steps=4, guidance_scale=scale, height=height, width=width,
                   generator=torch.Generator("cpu").manual_seed(42), num_images_per_prompt=n, output_type="np").images
    pipe = DiffusionPipeline.from_dir(flux_dir)
    assert pipe.model.guidance == "embedded" and pipe.model.shift_factor == pytest.approx(FLUX_SHIFT)
    latents = pipe.generate([PROMPT] * n, steps=4, guidance_scale=scale, seed=42, height=height, width=width)
    vae, _ = load_flow_autoencoder_kl(flux_dir / "vae")
    with torch.no_grad():
        images = vae.decode(latents)
    ours = ((images.clamp(-1, 1) + 1) * 127.5).round().permute(0, 2, 3, 1).numpy()
    theirs = np.round(expected * 255)
    assert ours.shape == theirs.shape == (n, height, width, 3)
    assert theirs.std() > 10
    assert np.abs(ours - theirs).max() <= 2


def _set_json(path: Path, **changes) -> None:
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: _set_json(d / "transformer" / "config.json", patch_size=2), "patch_size"),
    (lambda d: _set_json(d / "transformer" / "config.json", axes_dims_rope=[4, 4, 4]), "axes_dims_rope"),
    (lambda d: _set_json(d / "model_index.json", tokenizer_2=["transformers", "BertTokenizer"]), "tokenizer_2"),
    (lambda d: (d / "text_encoder_2" / "model.safetensors").unlink(), "model"),
])
def test_bad_folders_are_refused_with_what_is_wrong(flux_dir: Path, tmp_path: Path, edit, message: str) -> None:
    folder = tmp_path / "bad"
    shutil.copytree(flux_dir, folder)
    edit(folder)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_flux_components(folder)
