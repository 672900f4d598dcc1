"""Guidance modes in the generation loop: one batched U-Net call per step, seeded determinism, the defaults, and
``cfg`` equal, bit for bit, to the loop as it was before the modes existed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from genserve.services.diffusion.guidance import perp_neg
from genserve.services.diffusion.params import GUIDANCE_MODES
from genserve.services.diffusion.pipeline import DiffusionPipeline
from genserve.services.diffusion.schedulers import make_scheduler
from genserve.shared.blocks.cross_attention import ContextCache

PROMPTS = ["a large yellow square at the top left", "a small green triangle in the center"]
NEGATIVES = ["a green square", "a red circle"]


class CountingUNet(torch.nn.Module):
    """Wraps the U-Net and records the batch size of every call."""

    def __init__(self, unet: torch.nn.Module) -> None:
        super().__init__()
        self.unet = unet
        self.batches: list[int] = []

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self.batches.append(x.shape[0])
        return self.unet(x, *args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.unet, name)


@pytest.fixture
def counting(tiny_pipe: DiffusionPipeline, monkeypatch: pytest.MonkeyPatch) -> CountingUNet:
    wrapper = CountingUNet(tiny_pipe.model.unet)
    monkeypatch.setattr(tiny_pipe, "model", dataclasses.replace(tiny_pipe.model, unet=wrapper))
    return wrapper


@pytest.mark.parametrize(("guidance", "negatives", "rows"), [
    ("perp_neg", NEGATIVES, 3),  # prompt, empty caption, negative
    ("perp_neg", None, 2),  # no negative: no third pass
    ("perp_neg", ["", ""], 2),  # empty negatives are no negatives
    ("cfg", NEGATIVES, 2),  # the negative takes the empty caption's place
])
def test_every_step_is_one_unet_call_with_all_passes(tiny_pipe: DiffusionPipeline, counting: CountingUNet,
                                                      guidance: str, negatives: list[str] | None, rows: int) -> None:
    tiny_pipe.generate(PROMPTS, negatives, steps=4, guidance_scale=3.0, seed=0, guidance=guidance)
    assert counting.batches == [rows * len(PROMPTS)] * 4


def test_guidance_scale_one_runs_the_prompts_only_in_every_mode(tiny_pipe: DiffusionPipeline,
                                                                counting: CountingUNet) -> None:
    for guidance in GUIDANCE_MODES:
        tiny_pipe.generate(PROMPTS, NEGATIVES, steps=2, guidance_scale=1.0, seed=0, guidance=guidance)
    assert counting.batches == [len(PROMPTS)] * 4


def test_batched_perp_neg_equals_three_separate_passes(tiny_pipe: DiffusionPipeline) -> None:
    unet = tiny_pipe.model.unet
    x, t, w = torch.randn(2, 4, 8, 8), torch.tensor(600), 3.0
    with torch.no_grad():
        context = tiny_pipe.encode_prompts(PROMPTS + ["", ""] + NEGATIVES)
        batched = tiny_pipe.guided_output(x, t, context, w, guidance="perp_neg", negative_weight=0.7)
        cond, uncond, negative = (unet(x, t.expand(2), context[i : i + 2]) for i in (0, 2, 4))
    torch.testing.assert_close(batched, perp_neg(uncond, cond, negative, w, 0.7), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("guidance", GUIDANCE_MODES)
def test_each_mode_is_deterministic_for_a_seed(tiny_pipe: DiffusionPipeline, guidance: str) -> None:
    a = tiny_pipe.generate(PROMPTS, NEGATIVES, steps=4, seed=11, scheduler="ddpm", guidance=guidance)
    b = tiny_pipe.generate(PROMPTS, NEGATIVES, steps=4, seed=11, scheduler="ddpm", guidance=guidance)
    c = tiny_pipe.generate(PROMPTS, NEGATIVES, steps=4, seed=12, scheduler="ddpm", guidance=guidance)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (a - c).abs().max() > 1e-3


def test_the_modes_differ_only_when_a_negative_is_given(tiny_pipe: DiffusionPipeline) -> None:
    plain = {g: tiny_pipe.generate(PROMPTS, steps=3, seed=2, guidance=g) for g in GUIDANCE_MODES}
    negated = {g: tiny_pipe.generate(PROMPTS, NEGATIVES, steps=3, seed=2, guidance=g) for g in GUIDANCE_MODES}
    torch.testing.assert_close(plain["cfg"], plain["perp_neg"], rtol=0, atol=0)
    assert (negated["cfg"] - negated["perp_neg"]).abs().max() > 1e-4
    assert (negated["perp_neg"] - plain["perp_neg"]).abs().max() > 1e-4


def test_negative_weight_zero_ignores_the_negative(tiny_pipe: DiffusionPipeline) -> None:
    plain = tiny_pipe.generate(PROMPTS, steps=3, seed=5, guidance="perp_neg")
    weightless = tiny_pipe.generate(PROMPTS, NEGATIVES, steps=3, seed=5, guidance="perp_neg", negative_weight=0.0)
    torch.testing.assert_close(weightless, plain, rtol=1e-5, atol=1e-5)


def test_demo_model_defaults_to_perp_neg(tiny_pipe: DiffusionPipeline) -> None:
    assert tiny_pipe.model.default_guidance == "perp_neg"
    default = tiny_pipe.generate(PROMPTS, NEGATIVES, steps=3, seed=1)
    explicit = tiny_pipe.generate(PROMPTS, NEGATIVES, steps=3, seed=1, guidance="perp_neg",
                                  negative_weight=tiny_pipe.model.default_negative_weight)
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)


def _loop_before_guidance_modes(pipe: DiffusionPipeline, prompts: list[str], negatives: list[str] | None,
                                steps: int, w: float, seed: int, scheduler: str) -> torch.Tensor:
    """``generate`` as it was before guidance modes (commit d4bc044), written out: the negatives (or empty captions)
    as the unconditional half of one 2N batch, and out_u + w (out_c − out_u)."""
    n = len(prompts)
    uncond = negatives if negatives is not None else [""] * n
    with torch.inference_mode():
        cache = ContextCache(pipe.encode_prompts(prompts + uncond))
        generator = torch.Generator().manual_seed(seed)
        sampler = make_scheduler(scheduler, pipe.model.schedule(scheduler), eta=0.0)
        timesteps = sampler.set_timesteps(steps)
        latents = torch.randn((n, *pipe.latent_shape), generator=generator) * sampler.init_noise_sigma
        tembs = pipe.model.unet.time_embed(timesteps, latents.dtype)
        for i in range(steps):
            model_input = sampler.scale_model_input(latents, i)
            out = pipe.model.unet(torch.cat([model_input, model_input]), timesteps[i].expand(2 * n), cache,
                                  temb=tembs[i : i + 1])
            cond, uncond_out = out.chunk(2)
            latents = sampler.step(uncond_out + w * (cond - uncond_out), i, latents, generator=generator)
    return latents / pipe.model.scaling_factor


@pytest.mark.parametrize("scheduler", ["ddim", "dpmpp_2m"])
@pytest.mark.parametrize("negatives", [None, NEGATIVES])
def test_cfg_mode_is_the_old_loop_bit_for_bit(tiny_pipe: DiffusionPipeline, scheduler: str,
                                              negatives: list[str] | None) -> None:
    new = tiny_pipe.generate(PROMPTS, negatives, steps=5, guidance_scale=4.0, seed=9, scheduler=scheduler,
                             guidance="cfg")
    old = _loop_before_guidance_modes(tiny_pipe, PROMPTS, negatives, 5, 4.0, 9, scheduler)
    torch.testing.assert_close(new, old, rtol=0, atol=0)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"guidance": "perpneg"}, "guidance"),
    ({"negative_weight": -0.5}, "negative_weight"),
    ({"negative_weight": 11.0}, "negative_weight"),
])
def test_bad_guidance_settings_name_the_field(tiny_pipe: DiffusionPipeline, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        tiny_pipe.generate(PROMPTS, NEGATIVES, steps=1, **kwargs)
