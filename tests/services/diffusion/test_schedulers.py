"""Our samplers against diffusers' (test-only reference): timesteps, ᾱ and every step's output, ≤ 1e-5."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler as RefDDIM
from diffusers import DDPMScheduler as RefDDPM
from diffusers import DPMSolverMultistepScheduler as RefDPM

from services.diffusion.schedulers import (
    SCHEDULERS,
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    NoiseScheduleConfig,
    make_scheduler,
)
from services.diffusion.schedulers.schedule import add_noise, velocity

CONFIGS = [
    NoiseScheduleConfig(beta_schedule="linear", prediction_type="epsilon", timestep_spacing="leading"),
    NoiseScheduleConfig(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                        prediction_type="v_prediction", timestep_spacing="trailing"),
    NoiseScheduleConfig(beta_schedule="squaredcos_cap_v2", prediction_type="epsilon", timestep_spacing="trailing",
                        clip_sample_range=1.0),
]


def _ref_kwargs(c: NoiseScheduleConfig) -> dict:
    return dict(num_train_timesteps=c.num_train_timesteps, beta_start=c.beta_start, beta_end=c.beta_end,
                beta_schedule=c.beta_schedule, prediction_type=c.prediction_type, timestep_spacing=c.timestep_spacing)


def _clip_kwargs(c: NoiseScheduleConfig) -> dict:
    return dict(clip_sample=c.clip_sample_range is not None, clip_sample_range=c.clip_sample_range or 1.0)


def _fake_model(sample: torch.Tensor, t: int) -> torch.Tensor:
    """A deterministic stand-in for the denoiser that depends on both inputs."""
    return torch.tanh(sample * 0.7 + 0.001 * t) - 0.1


def _run(ours, ref, steps: int, ref_step_kwargs: dict, seed: int | None) -> None:
    ours_ts = ours.set_timesteps(steps)
    ref.set_timesteps(steps)
    torch.testing.assert_close(ours_ts, ref.timesteps.to(torch.int64), rtol=0, atol=0)
    x_ours = x_ref = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    g_ours = torch.Generator().manual_seed(seed) if seed is not None else None
    g_ref = torch.Generator().manual_seed(seed) if seed is not None else None
    for i, t in enumerate(ours_ts.tolist()):
        x_ours = ours.step(_fake_model(x_ours, t), i, x_ours, generator=g_ours)
        kw = dict(ref_step_kwargs, generator=g_ref) if seed is not None else ref_step_kwargs
        x_ref = ref.step(_fake_model(x_ref, t), t, x_ref, **kw).prev_sample
        torch.testing.assert_close(x_ours, x_ref, rtol=1e-5, atol=1e-5, msg=f"step {i} (t={t})")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.beta_schedule)
def test_alphas_cumprod_match_diffusers(config: NoiseScheduleConfig) -> None:
    ref = RefDDPM(**_ref_kwargs(config))
    torch.testing.assert_close(DDPMScheduler(config).alphas_cumprod, ref.alphas_cumprod, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.beta_schedule)
@pytest.mark.parametrize("steps", [20, 7])
def test_ddpm_steps_match_diffusers(config: NoiseScheduleConfig, steps: int) -> None:
    ref = RefDDPM(**_ref_kwargs(config), **_clip_kwargs(config), variance_type="fixed_small")
    _run(DDPMScheduler(config), ref, steps, {}, seed=3)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.beta_schedule)
@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0])
def test_ddim_steps_match_diffusers(config: NoiseScheduleConfig, eta: float) -> None:
    ref = RefDDIM(**_ref_kwargs(config), **_clip_kwargs(config), set_alpha_to_one=True)
    _run(DDIMScheduler(config, eta=eta), ref, 20, {"eta": eta}, seed=5 if eta > 0 else None)


# diffusers' DPM-Solver "leading" spacing divides T by n + 1 (unlike its DDIM), so parity is checked on "trailing".
# Cosine pairs with v here: ε at t = 999 divides by √ᾱ ≈ 5e-5, where float32 rounding alone exceeds 1e-5.
DPM_CONFIGS = [
    CONFIGS[1],
    NoiseScheduleConfig(beta_schedule="linear", prediction_type="epsilon", timestep_spacing="trailing"),
    NoiseScheduleConfig(beta_schedule="squaredcos_cap_v2", prediction_type="v_prediction", timestep_spacing="trailing"),
]


@pytest.mark.parametrize("config", DPM_CONFIGS, ids=lambda c: f"{c.beta_schedule}-{c.prediction_type}")
@pytest.mark.parametrize("steps", [20, 7])
def test_dpm_solver_pp_2m_steps_match_diffusers(config: NoiseScheduleConfig, steps: int) -> None:
    ref = RefDPM(**_ref_kwargs(config), algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint",
                 lower_order_final=True, final_sigmas_type="zero")
    _run(DPMSolverMultistepScheduler(config), ref, steps, {}, seed=None)


def test_add_noise_and_velocity_match_diffusers() -> None:
    config = CONFIGS[1]
    ref = RefDDPM(**_ref_kwargs(config))
    ours = DDPMScheduler(config)
    x0, noise = torch.randn(5, 4, 8, 8), torch.randn(5, 4, 8, 8)
    t = torch.tensor([0, 10, 500, 900, 999])
    torch.testing.assert_close(add_noise(ours.alphas_cumprod, x0, noise, t), ref.add_noise(x0, noise, t))
    torch.testing.assert_close(velocity(ours.alphas_cumprod, x0, noise, t), ref.get_velocity(x0, noise, t))


def test_ddim_last_step_returns_x0_prediction() -> None:
    config = CONFIGS[0]
    sched = DDIMScheduler(config)
    sched.set_timesteps(4)
    x, eps = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8)
    abar = sched.alphas_cumprod[int(sched.timesteps[-1])]
    expected = (x - (1 - abar).sqrt() * eps) / abar.sqrt()
    torch.testing.assert_close(sched.step(eps, 3, x), expected)


def test_make_scheduler_names_and_errors() -> None:
    config = NoiseScheduleConfig()
    kinds = [type(make_scheduler(name, config)) for name in SCHEDULERS]
    assert kinds == [DDPMScheduler, DDIMScheduler, DPMSolverMultistepScheduler]
    with pytest.raises(ValueError, match="scheduler"):
        make_scheduler("euler", config)
    with pytest.raises(ValueError, match="beta_schedule"):
        NoiseScheduleConfig(beta_schedule="sigmoid")
    with pytest.raises(ValueError, match="num_steps"):
        DDIMScheduler(config).set_timesteps(0)
