"""Our samplers against diffusers' (test-only reference): timesteps, ᾱ and every step's output, ≤ 1e-5."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler as RefDDIM
from diffusers import DDPMScheduler as RefDDPM
from diffusers import DPMSolverMultistepScheduler as RefDPM

from genserve.services.diffusion.schedulers import (
    SCHEDULERS,
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    NoiseScheduleConfig,
    make_scheduler,
)
from genserve.services.diffusion.schedulers.schedule import add_noise, velocity

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
    assert kinds == [DDPMScheduler, DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler]
    with pytest.raises(ValueError, match="scheduler"):
        make_scheduler("heun", config)
    with pytest.raises(ValueError, match="beta_schedule"):
        NoiseScheduleConfig(beta_schedule="sigmoid")
    with pytest.raises(ValueError, match="num_steps"):
        DDIMScheduler(config).set_timesteps(0)


# Stable Diffusion 1.x's scheduler settings: scaled-linear betas, "leading" + steps_offset 1, ᾱ_0 past the end.
SD_CONFIG = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")


@pytest.mark.parametrize("spacing", ["leading", "linspace", "trailing"])
@pytest.mark.parametrize("steps", [20, 7])
def test_ddim_with_sd_settings_matches_diffusers(spacing: str, steps: int) -> None:
    """steps_offset, set_alpha_to_one=False, and diffusers' t' = t − T/n even where n does not divide T."""
    config = NoiseScheduleConfig(**SD_CONFIG, timestep_spacing=spacing, steps_offset=1, set_alpha_to_one=False)
    ref = RefDDIM(**SD_CONFIG, timestep_spacing=spacing, steps_offset=1, set_alpha_to_one=False, clip_sample=False)
    _run(DDIMScheduler(config), ref, steps, {"eta": 0.0}, seed=None)


@pytest.mark.parametrize("spacing", ["leading", "linspace"])
def test_dpm_solver_pp_2m_leading_and_linspace_match_diffusers(spacing: str) -> None:
    config = NoiseScheduleConfig(**SD_CONFIG, timestep_spacing=spacing, steps_offset=1)
    ref = RefDPM(**SD_CONFIG, timestep_spacing=spacing, steps_offset=1)
    _run(DPMSolverMultistepScheduler(config), ref, 9, {}, seed=None)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("spacing", ["linspace", "leading", "trailing"])
def test_euler_matches_diffusers(prediction_type: str, spacing: str) -> None:
    """Fractional "linspace" timesteps, σ interpolation, init_noise_sigma, input scaling and every step ≤ 1e-5."""
    from diffusers import EulerDiscreteScheduler as RefEuler

    config = NoiseScheduleConfig(**SD_CONFIG, prediction_type=prediction_type, timestep_spacing=spacing,
                                 steps_offset=1)
    ref = RefEuler(**SD_CONFIG, prediction_type=prediction_type, timestep_spacing=spacing, steps_offset=1)
    ours = EulerDiscreteScheduler(config)
    timesteps = ours.set_timesteps(9)
    ref.set_timesteps(9)
    torch.testing.assert_close(timesteps, ref.timesteps, rtol=0, atol=0)
    assert ours.init_noise_sigma == pytest.approx(float(ref.init_noise_sigma), rel=1e-6)
    x_ours = x_ref = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1)) * ours.init_noise_sigma
    for i, t in enumerate(ref.timesteps):
        out_ours = _fake_model(ours.scale_model_input(x_ours, i), int(t))
        out_ref = _fake_model(ref.scale_model_input(x_ref, t), int(t))
        x_ours = ours.step(out_ours, i, x_ours)
        x_ref = ref.step(out_ref, t, x_ref).prev_sample
        torch.testing.assert_close(x_ours, x_ref, rtol=1e-5, atol=1e-5, msg=f"step {i} (t={float(t)})")


def test_scheduler_config_json_reads_like_from_config() -> None:
    """A folder's DDIM config switched to another sampler keeps its keys and takes that sampler's defaults."""
    from genserve.services.diffusion.sd_schedule import schedule_for

    raw = dict(RefDDIM(**SD_CONFIG, steps_offset=1, set_alpha_to_one=False, clip_sample=False).config)
    for sampler, ref_cls in (("ddim", RefDDIM), ("dpmpp_2m", RefDPM)):
        ours = make_scheduler(sampler, schedule_for(raw, sampler, "scheduler_config.json"))
        ref = ref_cls.from_config(raw)
        ref.set_timesteps(12)
        torch.testing.assert_close(ours.set_timesteps(12), ref.timesteps.to(torch.int64), rtol=0, atol=0)
    legacy = {k: v for k, v in raw.items() if k != "timestep_spacing"}  # SD 1.x files predate the key
    assert schedule_for(legacy, "euler", "f").timestep_spacing == "linspace"
    assert schedule_for(legacy, "ddim", "f").timestep_spacing == "leading"
    assert schedule_for({}, "ddim", "f").clip_sample_range == 1.0  # DDIM's default clip_sample=True


@pytest.mark.parametrize(("raw", "sampler", "key"), [
    ({"trained_betas": [0.1, 0.2]}, "ddim", "trained_betas"),
    ({"rescale_betas_zero_snr": True}, "ddim", "rescale_betas_zero_snr"),
    ({"beta_schedule": "sigmoid"}, "ddim", "beta_schedule"),
    ({"prediction_type": "sample"}, "euler", "prediction_type"),
    ({"use_karras_sigmas": True}, "dpmpp_2m", "use_karras_sigmas"),
    ({"algorithm_type": "sde-dpmsolver++"}, "dpmpp_2m", "algorithm_type"),
    ({"interpolation_type": "log_linear"}, "euler", "interpolation_type"),
])
def test_unsupported_scheduler_options_are_refused_by_name(raw: dict, sampler: str, key: str) -> None:
    from genserve.services.diffusion.sd_schedule import schedule_for

    with pytest.raises(ValueError, match=f"scheduler_config.json.*: {key}="):
        schedule_for(raw, sampler, "scheduler/scheduler_config.json")
