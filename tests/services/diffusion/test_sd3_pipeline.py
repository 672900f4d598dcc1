"""An SD3-format diffusers folder in our pipeline: T5 ids and states, both CLIPs' penultimate and pooled outputs, the
MMDiT's velocity and the flow-match σ against transformers' and diffusers' own classes, images seed for seed against
StableDiffusion3Pipeline (within 2/255 per pixel, fp32, CPU, CFG with and without a negative prompt, non-square), and
bad folders, samplers and sizes refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from genserve.services.diffusion.clip_tokenizer import CLIPTokenizer
from genserve.services.diffusion.flow_match import FlowMatchConfig, FlowMatchEulerScheduler
from genserve.services.diffusion.mmdit import load_mmdit
from genserve.services.diffusion.pipeline import DiffusionPipeline
from genserve.services.diffusion.sd3_folder import load_sd3_components
from genserve.services.diffusion.sd_text import load_clip_with_projection
from genserve.services.diffusion.t5_text import T5Tokenizer, load_t5_encoder
from genserve.services.diffusion.text_conditioning import TextConditioning
from genserve.shared.blocks.autoencoder_kl_flow import load_flow_autoencoder_kl
from tests.services.diffusion.tiny_sd import CAPTIONS
from tests.services.diffusion.tiny_sd3 import SD3_SHIFT, build_tiny_sd3

PROMPT = "An astronaut riding a horse, oil painting"


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_sd3(tmp_path_factory.mktemp("sd3") / "pipeline", latent=8)  # 64×64 native


@pytest.fixture(scope="module")
def reference(sd3_dir: Path):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_t5_ids_and_states_match_transformers(sd3_dir: Path) -> None:
    from transformers import AutoTokenizer, T5EncoderModel

    ref_tok = AutoTokenizer.from_pretrained(sd3_dir / "tokenizer_3")
    prompts = CAPTIONS[:4] + ["", "Café crème — 12345!!", " ".join(["astronaut"] * 90)]  # the last is truncated
    expected = ref_tok(prompts, padding="max_length", max_length=64, truncation=True).input_ids
    ids = T5Tokenizer(sd3_dir / "tokenizer_3", 64)(prompts)
    assert ids.tolist() == expected and ids[-1, -1] == 1  # </s> kept at the end of a truncated prompt
    ref = T5EncoderModel.from_pretrained(sd3_dir / "text_encoder_3").eval()
    with torch.no_grad():
        torch.testing.assert_close(load_t5_encoder(sd3_dir / "text_encoder_3")(ids), ref(ids)[0], rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("which", ["", "_2"])
def test_clip_penultimate_and_pooled_match_transformers(sd3_dir: Path, which: str) -> None:
    from transformers import CLIPTextModelWithProjection

    ref = CLIPTextModelWithProjection.from_pretrained(sd3_dir / f"text_encoder{which}").eval()
    ids = CLIPTokenizer(sd3_dir / f"tokenizer{which}")(CAPTIONS[:3] + [""])
    with torch.no_grad():
        hidden, pooled = load_clip_with_projection(sd3_dir / f"text_encoder{which}")(ids)
        out = ref(ids, output_hidden_states=True)
    torch.testing.assert_close(hidden, out.hidden_states[-2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pooled, out.text_embeds, rtol=1e-5, atol=1e-5)


def test_mmdit_velocity_matches_sd3_transformer(sd3_dir: Path) -> None:
    from diffusers import SD3Transformer2DModel

    ref = SD3Transformer2DModel.from_pretrained(sd3_dir / "transformer").eval()
    torch.manual_seed(0)
    x, ctx, pooled, t = torch.randn(2, 16, 6, 10), torch.randn(2, 20, 80), torch.randn(2, 64), torch.tensor([981., 3.])
    with torch.no_grad():
        expected = ref(hidden_states=x, timestep=t, encoder_hidden_states=ctx, pooled_projections=pooled).sample
        ours = load_mmdit(sd3_dir / "transformer")(x, t, TextConditioning(ctx, pooled))
    assert expected.abs().mean() > 0.1
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("steps", [4, 28])
@pytest.mark.parametrize("dynamic", [False, True])
def test_flow_match_sigmas_match_diffusers(steps: int, dynamic: bool) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    kwargs = {"use_dynamic_shifting": True} if dynamic else {"shift": 3.0}
    ref = FlowMatchEulerDiscreteScheduler(**kwargs)
    config = FlowMatchConfig(**kwargs)
    ref.set_timesteps(steps, mu=config.mu(1024) if dynamic else None)
    ours = FlowMatchEulerScheduler(config, image_seq_len=1024)
    torch.testing.assert_close(ours.set_timesteps(steps), ref.timesteps, rtol=0, atol=0)
    torch.testing.assert_close(ours.sigmas, ref.sigmas, rtol=0, atol=0)
    x, v = torch.randn(1, 4, 2, 2), torch.randn(1, 4, 2, 2)
    torch.testing.assert_close(ours.step(v, 0, x), ref.step(v, ref.timesteps[0], x).prev_sample)


def _pixels(latents: torch.Tensor, vae_dir: Path) -> np.ndarray:
    vae, _ = load_flow_autoencoder_kl(vae_dir)
    with torch.no_grad():
        images = vae.decode(latents)  # (n, 3, H, W) in about [-1, 1]
    return ((images.clamp(-1, 1) + 1) * 127.5).round().permute(0, 2, 3, 1).numpy()


# (negative prompt, n, height, width, guidance scale): CFG with a negative prompt, and none (w = 1; the empty
# negative is the default of test_edits' SD3 image-to-image case)
@pytest.mark.parametrize(("negative", "n", "height", "width", "scale"), [
    ("blurry, low quality", 2, 48, 80, 5.0),
    (None, 1, 80, 48, 1.0),
])
def test_images_match_stable_diffusion_3_pipeline_seed_for_seed(sd3_dir, reference, negative: str | None, n: int,
                                                                height: int, width: int, scale: float) -> None:
    expected = reference(PROMPT, negative_prompt=negative, num_inference_steps=4, guidance_scale=scale, height=height,
                         width=width, generator=torch.Generator("cpu").manual_seed(42), num_images_per_prompt=n,
                         output_type="np").images  # (n, H, W, 3) in [0, 1]
    pipe = DiffusionPipeline.from_dir(sd3_dir)
    latents = pipe.generate([PROMPT] * n, [negative] * n if negative else None, steps=4, guidance_scale=scale,
                            seed=42, height=height, width=width)  # scheduler None: the folder's flow-match Euler
    ours, theirs = _pixels(latents, sd3_dir / "vae"), np.round(expected * 255)
    assert ours.shape == theirs.shape == (n, height, width, 3)
    assert theirs.std() > 10
    assert np.abs(ours - theirs).max() <= 2


def test_folder_settings_and_refusals(sd3_dir: Path) -> None:
    pipe = DiffusionPipeline.from_dir(sd3_dir)
    assert pipe.model.native_size == (64, 64) and pipe.latent_shape == (16, 8, 8)
    assert pipe.model.shift_factor == pytest.approx(SD3_SHIFT) and pipe.model.flow.shift == 3.0
    assert pipe.size_error(48, 80) is None
    assert pipe.size_error(40, 64) == ("height", "must be a positive multiple of 16, got 40")
    assert pipe.option_error("ddim")[0] == "scheduler" and pipe.option_error("euler") is None
    with pytest.raises(ValueError, match="^scheduler: .*flow-match Euler"):
        pipe.generate(["a cat"], steps=1, scheduler="ddim")


def _set_json(path: Path, **changes) -> None:
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: _set_json(d / "transformer" / "config.json", dual_attention_layers=[0]), "dual_attention_layers"),
    (lambda d: _set_json(d / "scheduler" / "scheduler_config.json", stochastic_sampling=True), "stochastic_sampling"),
    (lambda d: _set_json(d / "model_index.json", text_encoder_2=["transformers", "CLIPTextModel"]), "text_encoder_2"),
    (lambda d: _set_json(d / "text_encoder_3" / "config.json", feed_forward_proj="gated-foo"), "feed_forward_proj"),
])
def test_bad_folders_are_refused_with_what_is_wrong(sd3_dir: Path, tmp_path: Path, edit, message: str) -> None:
    folder = tmp_path / "bad"
    shutil.copytree(sd3_dir, folder)
    edit(folder)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_sd3_components(folder)


def test_the_vae_app_serves_the_folders_16_channel_vae(sd3_dir: Path) -> None:
    """The vae app given an SD3 folder loads its VAE without quant convs, as the pipeline does."""
    from genserve.services.vae.app import load_any_vae

    vae, any_size = load_any_vae(str(sd3_dir), torch.device("cpu"))
    ours, _ = load_flow_autoencoder_kl(sd3_dir / "vae")
    assert any_size
    x = torch.rand(1, 3, 32, 48) * 2 - 1
    with torch.no_grad():
        mean = vae.encode(x)[0]
        assert mean.shape[1] == 16 and torch.equal(mean, ours.encode(x)[0])
