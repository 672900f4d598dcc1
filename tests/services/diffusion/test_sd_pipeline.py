"""A Stable-Diffusion-format diffusers folder in our pipeline: tokenizer ids, text-encoder states and U-Net outputs
against transformers' and diffusers' own classes, images seed for seed against StableDiffusionPipeline (within
2/255 per pixel, fp32, CPU), and clear errors for bad folders and sizes."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from genserve.services.diffusion.clip_tokenizer import CLIPTokenizer
from genserve.services.diffusion.pipeline import DiffusionPipeline
from genserve.services.diffusion.sd_folder import load_sd_components
from genserve.services.diffusion.sd_text import load_clip_text
from genserve.services.diffusion.sd_unet import load_unet
from genserve.shared.blocks.autoencoder_kl import load_autoencoder_kl
from tests.services.diffusion.tiny_sd import CAPTIONS, build_tiny_sd, write_clip_vocab

STEPS = 4


@pytest.fixture(scope="module")
def sd_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny pipelines that differ only in prediction type (64×64 native, 8×8 latents)."""
    root = tmp_path_factory.mktemp("sd")
    eps = build_tiny_sd(root / "eps", latent=8)
    v = root / "v"
    shutil.copytree(eps, v)
    config = json.loads((v / "scheduler" / "scheduler_config.json").read_text())
    (v / "scheduler" / "scheduler_config.json").write_text(json.dumps(dict(config, prediction_type="v_prediction")))
    return {"epsilon": eps, "v_prediction": v}


@pytest.fixture(scope="module")
def reference(sd_dirs: dict[str, Path]):
    from diffusers import StableDiffusionPipeline

    def load(prediction_type: str):
        pipe = StableDiffusionPipeline.from_pretrained(sd_dirs[prediction_type], safety_checker=None,
                                                       requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    return {kind: load(kind) for kind in sd_dirs}


def _captions(n: int = 200) -> list[str]:
    """Varied captions: punctuation, upper case, accents, digits, runs of spaces, and overlong text."""
    rng = random.Random(0)
    extras = ["Café crème à Paris", "ÉLAN vital — naïve façade", "über-cool straße", "Ⅻ roman numerals ½",
              "emoji 🐱 cat", "tabs\tand\nnewlines", "  leading and trailing  ", "it's the dog's 3rd toy!!",
              "UPPER lower MiXeD", "a,b;c:d", "quotes \"double\" and 'single'", "<|endoftext|> inside text",
              "numbers 12345 and 3.14159", "hyphen-ated and under_scored", ""]
    words = " ".join(CAPTIONS + extras).split()
    captions = list(extras)
    while len(captions) < n - 10:
        caption = " ".join(rng.choice(words) for _ in range(rng.randint(1, 20)))
        captions.append(caption.upper() if rng.random() < 0.2 else caption)
    captions += [" ".join(rng.choice(words) for _ in range(rng.randint(80, 160))) for _ in range(10)]  # > 77 tokens
    return captions


@pytest.mark.parametrize("source", ["vocab_merges", "tokenizer_json", "pad_bang"])
def test_tokenizer_ids_equal_clip_tokenizers(sd_dirs: dict[str, Path], tmp_path: Path, source: str) -> None:
    from transformers import CLIPTokenizer as RefTokenizer

    if source == "vocab_merges":
        directory = sd_dirs["epsilon"].parent / "eps-vocab"  # vocab.json + merges.txt + tokenizer_config.json only
    elif source == "tokenizer_json":
        directory = tmp_path / "tok"
        shutil.copytree(sd_dirs["epsilon"] / "tokenizer", directory)
        (directory / "vocab.json").unlink()
        (directory / "merges.txt").unlink()
    else:  # SD 2.x pads with "!" instead of <|endoftext|>
        directory = write_clip_vocab(tmp_path / "bang", pad_token="!")
    ref = RefTokenizer.from_pretrained(directory)
    captions = _captions()
    expected = ref(captions, padding="max_length", max_length=ref.model_max_length, truncation=True).input_ids
    ours = CLIPTokenizer(directory)(captions)
    assert ours.shape == (200, 77)
    for caption, row, ref_row in zip(captions, ours.tolist(), expected, strict=True):
        assert row == ref_row, caption


def test_text_encoder_hidden_states_match_clip_text_model(sd_dirs: dict[str, Path]) -> None:
    from transformers import CLIPTextModel

    ref = CLIPTextModel.from_pretrained(sd_dirs["epsilon"] / "text_encoder").eval()
    ours = load_clip_text(sd_dirs["epsilon"] / "text_encoder")
    ids = CLIPTokenizer(sd_dirs["epsilon"] / "tokenizer")(CAPTIONS[:4] + [""])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).last_hidden_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hw", [(8, 8), (8, 12), (9, 7)])
def test_unet_output_matches_unet2dconditionmodel(sd_dirs: dict[str, Path], hw: tuple[int, int]) -> None:
    """Values, not names: GEGLU, 1×1-conv projections, heads from attention_head_dim, odd sizes rounded up."""
    from diffusers import UNet2DConditionModel

    ref = UNet2DConditionModel.from_pretrained(sd_dirs["epsilon"] / "unet").eval()
    ours, _ = load_unet(sd_dirs["epsilon"] / "unet")
    torch.manual_seed(0)
    x, ctx, t = torch.randn(2, 4, *hw), torch.randn(2, 77, 64), torch.tensor([981, 3])
    with torch.no_grad():
        torch.testing.assert_close(ours(x, t, ctx), ref(x, t, encoder_hidden_states=ctx).sample, rtol=1e-4,
                                   atol=1e-4)


# (sampler, prediction type, negative prompt, n, height, width): every sampler, both predictions, with and without
# a negative prompt, n = 1 and 2, square and non-square.
CASES = [
    ("ddim", "epsilon", None, 1, 64, 64),
    ("ddim", "v_prediction", "blurry, low quality", 2, 48, 80),
    ("dpmpp_2m", "epsilon", "blurry, low quality", 2, 64, 64),
    ("dpmpp_2m", "v_prediction", None, 1, 80, 48),
    ("euler", "epsilon", None, 2, 48, 80),
    ("euler", "v_prediction", "blurry, low quality", 1, 64, 64),
]


@pytest.mark.parametrize(("sampler", "prediction", "negative", "n", "height", "width"), CASES)
def test_images_match_stable_diffusion_pipeline_seed_for_seed(sd_dirs, reference, sampler: str, prediction: str,
                                                              negative: str | None, n: int, height: int,
                                                              width: int) -> None:
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler

    ref = reference[prediction]
    cls = {"ddim": DDIMScheduler, "dpmpp_2m": DPMSolverMultistepScheduler, "euler": EulerDiscreteScheduler}[sampler]
    ref.scheduler = cls.from_config(ref.scheduler.config)
    prompt = "An astronaut riding a horse, oil painting"
    expected = ref(prompt, negative_prompt=negative, num_inference_steps=STEPS, guidance_scale=7.5, height=height,
                   width=width, generator=torch.Generator("cpu").manual_seed(42), num_images_per_prompt=n,
                   output_type="np").images  # (n, H, W, 3) in [0, 1]
    pipe = DiffusionPipeline.from_dir(sd_dirs[prediction])
    latents = pipe.generate([prompt] * n, [negative] * n if negative else None, steps=STEPS, guidance_scale=7.5,
                            seed=42, scheduler=sampler, height=height, width=width)
    vae = load_autoencoder_kl(sd_dirs[prediction] / "vae")
    with torch.no_grad():
        images = vae.decode(latents)  # (n, 3, H, W) in about [-1, 1]
    ours = ((images.clamp(-1, 1) + 1) * 127.5).round().permute(0, 2, 3, 1).numpy()
    theirs = np.round(expected * 255)
    assert ours.shape == theirs.shape == (n, height, width, 3)
    assert theirs.std() > 10  # a real image, not a saturated one
    assert np.abs(ours - theirs).max() <= 2


def test_default_sampler_and_sizes_come_from_the_folder(sd_dirs: dict[str, Path]) -> None:
    pipe = DiffusionPipeline.from_dir(sd_dirs["epsilon"])
    assert pipe.model.default_scheduler == "ddim"  # model_index.json names DDIMScheduler
    assert pipe.model.native_size == (64, 64) and pipe.latent_shape == (4, 8, 8)
    assert pipe.model.scaling_factor == pytest.approx(0.18215)
    assert pipe.model.max_pixels == 4 * 64 * 64
    assert pipe.model.default_guidance == "cfg"  # diffusers' own guidance, so seed-for-seed parity holds


@pytest.mark.parametrize(("size", "field", "message"), [
    ((60, 64), "height", "multiple of 8, got 60"),
    ((64, 0), "width", "multiple of 8, got 0"),
    ((256, 256), "width", "at most 16384 pixels"),
])
def test_bad_sizes_name_the_field(sd_dirs: dict[str, Path], size: tuple[int, int], field: str, message: str) -> None:
    pipe = DiffusionPipeline.from_dir(sd_dirs["epsilon"])
    assert pipe.size_error(64, 64) is None and pipe.size_error(48, 120) is None
    got = pipe.size_error(*size)
    assert got is not None and got[0] == field and message in got[1]
    with pytest.raises(ValueError, match=f"^{field}: "):
        pipe.generate(["a cat"], steps=1, height=size[0], width=size[1])


def _broken(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def _set_json(path: Path, **changes) -> None:
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: (d / "unet" / "diffusion_pytorch_model.safetensors").unlink(), "diffusion_pytorch_model.safetensors"),
    (lambda d: shutil.rmtree(d / "text_encoder"), "text_encoder"),
    (lambda d: (d / "scheduler" / "scheduler_config.json").unlink(), "scheduler_config.json not found"),
    (lambda d: (d / "tokenizer" / "tokenizer.json").unlink() or (d / "tokenizer" / "vocab.json").unlink(),
     "tokenizer.json"),
    (lambda d: _set_json(d / "model_index.json", _class_name="StableDiffusionXLPipeline"), "StableDiffusionXLPipeline"),
    (lambda d: _set_json(d / "model_index.json", unet=["diffusers", "UNet2DModel"]), "UNet2DModel"),
    (lambda d: _set_json(d / "model_index.json", scheduler=["diffusers", "LCMScheduler"]), "LCMScheduler"),
    (lambda d: _set_json(d / "unet" / "config.json", class_embed_type="timestep"), "class_embed_type"),
    (lambda d: _set_json(d / "unet" / "config.json", transformer_layers_per_block=2), "transformer_layers_per_block"),
    (lambda d: _set_json(d / "vae" / "config.json", shift_factor=0.1159), "shift_factor"),
    (lambda d: _set_json(d / "text_encoder" / "config.json", hidden_act="relu"), "hidden_act"),
    (lambda d: _set_json(d / "scheduler" / "scheduler_config.json", trained_betas=[0.1]), "trained_betas"),
    (lambda d: _set_json(d / "unet" / "config.json", cross_attention_dim=32), "unet"),
])
def test_bad_folders_are_refused_with_what_is_wrong(sd_dirs: dict[str, Path], tmp_path: Path, edit,
                                                    message: str) -> None:
    folder = _broken(sd_dirs["epsilon"], tmp_path / "bad", edit)
    with pytest.raises((ValueError, FileNotFoundError), match=message.replace("(", r"\(")):
        load_sd_components(folder)
