"""The generation loop: guidance batching, progress, cancellation, determinism, validation, preview, checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genserve.services.diffusion.model import DEFAULT_WEIGHTS, LatentDiffusion, load_diffusion, save_diffusion
from genserve.services.diffusion.params import MAX_BATCH, MAX_STEPS, SCHEDULERS, GenerationCancelled
from genserve.services.diffusion.pipeline import DiffusionPipeline
from genserve.services.diffusion.schedulers import make_scheduler
from genserve.services.diffusion.schedulers.schedule import alphas_cumprod

PROMPTS = ["a large red circle at the top left", "a small blue square in the center"]


def test_guided_output_in_one_batch_equals_two_separate_passes(tiny_pipe: DiffusionPipeline) -> None:
    unet = tiny_pipe.model.unet
    x, t, w = torch.randn(2, 4, 8, 8), torch.tensor(400), 3.0
    with torch.no_grad():
        context = tiny_pipe.encode_prompts(PROMPTS + ["", "a green cross"])
        batched = tiny_pipe.guided_output(x, t, context, w)
        cond = unet(x, t.expand(2), context[:2])
        uncond = unet(x, t.expand(2), context[2:])
    torch.testing.assert_close(batched, uncond + w * (cond - uncond), rtol=1e-4, atol=1e-5)


def test_guidance_scale_one_is_the_conditional_model(tiny_pipe: DiffusionPipeline) -> None:
    x, t = torch.randn(2, 4, 8, 8), torch.tensor(10)
    with torch.no_grad():
        context = tiny_pipe.encode_prompts(PROMPTS + ["", ""])
        torch.testing.assert_close(tiny_pipe.guided_output(x, t, context, 1.0),
                                   tiny_pipe.model.unet(x, t.expand(2), context[:2]))


def test_unet_is_called_once_per_step_with_the_doubled_batch(tiny_pipe: DiffusionPipeline) -> None:
    batch_sizes = []
    handle = tiny_pipe.model.unet.register_forward_hook(lambda m, args, out: batch_sizes.append(args[0].shape[0]))
    tiny_pipe.generate(PROMPTS, steps=3, guidance_scale=2.0, seed=0)
    handle.remove()
    assert batch_sizes == [4, 4, 4]


def _generate_without_cache(pipe: DiffusionPipeline, prompts: list[str], steps: int, w: float,
                            seed: int) -> torch.Tensor:
    """generate() written out with the raw text context, so every step projects it to keys and values again."""
    n = len(prompts)
    with torch.no_grad():
        context = pipe.encode_prompts(prompts + [""] * n)
        generator = torch.Generator().manual_seed(seed)
        sampler = make_scheduler("ddim", pipe.model.schedule("ddim"))
        latents = torch.randn((n, *pipe.latent_shape), generator=generator)
        for i, t in enumerate(sampler.set_timesteps(steps)):
            latents = sampler.step(pipe.guided_output(latents, t, context, w), i, latents, generator=generator)
    return latents / pipe.model.scaling_factor


@pytest.mark.parametrize("guidance_scale", [3.0, 1.0])
def test_cached_text_keys_and_values_give_the_uncached_latents(tiny_pipe: DiffusionPipeline,
                                                              guidance_scale: float) -> None:
    cached = tiny_pipe.generate(PROMPTS, steps=6, guidance_scale=guidance_scale, seed=4)
    uncached = _generate_without_cache(tiny_pipe, PROMPTS, 6, guidance_scale, seed=4)
    torch.testing.assert_close(cached, uncached, rtol=1e-5, atol=1e-5)


def test_text_is_projected_once_per_cross_attention_layer(tiny_pipe: DiffusionPipeline) -> None:
    layers = [m for name, m in tiny_pipe.model.unet.named_modules() if name.endswith("attn2.to_k")]
    calls = []
    handles = [layer.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0])) for layer in layers]
    tiny_pipe.generate(PROMPTS, steps=5, seed=0)
    for handle in handles:
        handle.remove()
    assert len(layers) > 0 and calls == [2 * len(PROMPTS)] * len(layers)


def test_on_step_reports_every_step(tiny_pipe: DiffusionPipeline) -> None:
    calls = []
    final = tiny_pipe.generate(PROMPTS, steps=5, seed=1, on_step=lambda i, n, z: calls.append((i, n, z.clone())))
    assert [(i, n) for i, n, _ in calls] == [(k, 5) for k in range(1, 6)]
    assert calls[-1][2].shape == (2, *tiny_pipe.latent_shape)
    torch.testing.assert_close(calls[-1][2], final, rtol=0, atol=0)


def test_cancellation_stops_between_steps(tiny_pipe: DiffusionPipeline) -> None:
    progress = []
    checks = iter([False, False, False, True, True])
    with pytest.raises(GenerationCancelled):
        tiny_pipe.generate(PROMPTS, steps=10, seed=0, on_step=lambda i, n, z: progress.append(i),
                           should_cancel=lambda: next(checks))
    assert progress == [1, 2, 3]


def test_same_seed_same_latents_and_different_seed_different(tiny_pipe: DiffusionPipeline) -> None:
    for scheduler in SCHEDULERS:
        a = tiny_pipe.generate(PROMPTS, steps=4, seed=7, scheduler=scheduler, eta=0.5)
        b = tiny_pipe.generate(PROMPTS, steps=4, seed=7, scheduler=scheduler, eta=0.5)
        c = tiny_pipe.generate(PROMPTS, steps=4, seed=8, scheduler=scheduler, eta=0.5)
        assert torch.isfinite(a).all(), scheduler
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert (a - c).abs().max() > 1e-3, scheduler


def test_negative_prompt_replaces_the_empty_caption_under_cfg(tiny_pipe: DiffusionPipeline) -> None:
    default = tiny_pipe.generate(PROMPTS, steps=3, seed=3, guidance="cfg")
    empty = tiny_pipe.generate(PROMPTS, ["", ""], steps=3, seed=3, guidance="cfg")
    negative = tiny_pipe.generate(PROMPTS, ["a red circle", "a blue square"], steps=3, seed=3, guidance="cfg")
    torch.testing.assert_close(default, empty, rtol=0, atol=0)
    assert (default - negative).abs().max() > 1e-4


def test_latents_come_back_unscaled(tiny_pipe: DiffusionPipeline) -> None:
    """With one DDIM step from t = T−1 the output is x̂_0 / scaling_factor; check it against the model output."""
    pipe = tiny_pipe
    latents = pipe.generate(PROMPTS[:1], steps=1, guidance_scale=1.0, seed=5)
    noise = torch.randn((1, *pipe.latent_shape), generator=torch.Generator().manual_seed(5))
    sampler_t = torch.tensor(pipe.model.schedule("ddim").num_train_timesteps - 1)
    with torch.no_grad():
        v = pipe.model.unet(noise, sampler_t.expand(1), pipe.encode_prompts(PROMPTS[:1]))
    abar = alphas_cumprod(pipe.model.schedule("ddim"))[-1]
    x0 = abar.sqrt() * noise - (1 - abar).sqrt() * v
    torch.testing.assert_close(latents, x0 / pipe.model.scaling_factor, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"steps": 0}, "steps"),
    ({"steps": MAX_STEPS + 1}, "steps"),
    ({"guidance_scale": -1.0}, "guidance_scale"),
    ({"scheduler": "heun"}, "scheduler"),
    ({"eta": 2.0}, "eta"),
    ({"negative_prompts": ["x"]}, "negative_prompts"),
])
def test_invalid_requests_raise_value_error(tiny_pipe: DiffusionPipeline, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        tiny_pipe.generate(PROMPTS, **kwargs)


def test_batch_limit(tiny_pipe: DiffusionPipeline) -> None:
    with pytest.raises(ValueError, match="prompts"):
        tiny_pipe.generate(["a red circle"] * (MAX_BATCH + 1), steps=1)


def test_preview_is_a_low_res_rgb_image(tiny_pipe: DiffusionPipeline) -> None:
    out = tiny_pipe.preview(torch.randn(3, *tiny_pipe.latent_shape) * 10)
    assert out.shape == (3, 3, 8, 8)
    assert out.min() >= -1 and out.max() <= 1


def test_checkpoint_round_trip(tiny_model: LatentDiffusion, tmp_path: Path) -> None:
    save_diffusion(tmp_path, tiny_model)
    loaded = load_diffusion(tmp_path)
    assert loaded.config == tiny_model.config
    for (name, a), b in zip(tiny_model.state_dict().items(), loaded.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    a = DiffusionPipeline(tiny_model).generate(PROMPTS, steps=3, seed=0)
    b = DiffusionPipeline.from_dir(tmp_path).generate(PROMPTS, steps=3, seed=0)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_committed_weights_load_and_generate() -> None:
    pipe = DiffusionPipeline.from_dir()
    assert (DEFAULT_WEIGHTS / "model.safetensors").stat().st_size <= 15 * 2**20
    latents = pipe.generate(["a large blue square at the bottom right"], steps=2, seed=0)
    assert latents.shape == (1, *pipe.latent_shape)
    assert torch.isfinite(latents).all()


def test_the_loop_never_copies_to_the_host(tiny_pipe: DiffusionPipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step stays on the pipeline's device: no .cpu(), .item() or .tolist() on any tensor inside generate()
    (the samplers' own schedules are host tensors from the start and are only indexed)."""
    def refuse(*args, **kwargs):
        raise AssertionError("host copy inside the denoising loop")

    reference = tiny_pipe.generate(PROMPTS, steps=3, seed=2, scheduler="dpmpp_2m")
    for name in ("cpu", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for scheduler in SCHEDULERS:
        latents = tiny_pipe.generate(PROMPTS, steps=3, seed=2, scheduler=scheduler, eta=0.5)
        assert latents.shape == (2, *tiny_pipe.latent_shape)
    monkeypatch.undo()
    torch.testing.assert_close(tiny_pipe.generate(PROMPTS, steps=3, seed=2, scheduler="dpmpp_2m"), reference)
