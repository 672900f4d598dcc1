"""The forward (noising) process shared by every sampler: beta schedules, ᾱ_t, timestep spacing, targets.

Notation follows Ho et al. 2020 (DDPM): β_t, α_t = 1 − β_t, ᾱ_t = ∏_{s≤t} α_s, and the forward marginal
q(x_t | x_0) = N(√ᾱ_t x_0, (1 − ᾱ_t) I) (DDPM Eq. 4). Timesteps are 0-based integers in [0, T).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

BetaSchedule = Literal["linear", "scaled_linear", "squaredcos_cap_v2"]
PredictionType = Literal["epsilon", "v_prediction"]
TimestepSpacing = Literal["leading", "trailing", "linspace"]

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
PREDICTION_TYPES = ("epsilon", "v_prediction")
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")


@dataclass(frozen=True)
class NoiseScheduleConfig:
    """The training noise schedule; samplers read it, so a checkpoint's schedule travels in its config.json."""

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: BetaSchedule = "linear"
    prediction_type: PredictionType = "epsilon"
    # "leading" (DDIM paper), "trailing" (Lin et al. 2023, Table 2: starts sampling at t = T − 1) or "linspace"
    # (evenly from T − 1 down to 0); the three spacings of diffusers' schedulers, with their rounding.
    timestep_spacing: TimestepSpacing = "leading"
    # Added to "leading" timesteps (Stable Diffusion: 1, so sampling ends at t = 1).
    steps_offset: int = 0
    # DDIM's ᾱ past the last step: 1 (x_0 itself) or, when False, ᾱ_0 (Stable Diffusion 1.x).
    set_alpha_to_one: bool = True
    # Clamp the predicted x_0 to [-r, r]; None for latent diffusion, whose latents are not bounded.
    clip_sample_range: float | None = None

    def __post_init__(self) -> None:
        if self.num_train_timesteps < 2:
            raise ValueError(f"num_train_timesteps must be >= 2, got {self.num_train_timesteps}")
        if not 0.0 < self.beta_start < self.beta_end < 1.0:
            raise ValueError(f"beta_start/beta_end must satisfy 0 < start < end < 1, got {self.beta_start}, "
                             f"{self.beta_end}")
        if self.beta_schedule not in BETA_SCHEDULES:
            raise ValueError(f"beta_schedule must be one of {BETA_SCHEDULES}, got {self.beta_schedule!r}")
        if self.prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {self.prediction_type!r}")
        if self.timestep_spacing not in TIMESTEP_SPACINGS:
            raise ValueError(f"timestep_spacing must be one of {TIMESTEP_SPACINGS}, got {self.timestep_spacing!r}")
        if self.steps_offset < 0:
            raise ValueError(f"steps_offset must be >= 0, got {self.steps_offset}")
        if self.clip_sample_range is not None and self.clip_sample_range <= 0:
            raise ValueError(f"clip_sample_range must be positive or None, got {self.clip_sample_range}")


def _cosine_alpha_bar(t: float) -> float:
    """f(t) of Nichol & Dhariwal 2021, Eq. 17 (offset s = 0.008), before normalising by f(0)."""
    return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2


def betas(config: NoiseScheduleConfig) -> torch.Tensor:
    """β_1..β_T as float32: linear (DDPM §4), scaled-linear (linear in √β, Stable Diffusion) or cosine."""
    n = config.num_train_timesteps
    if config.beta_schedule == "linear":
        return torch.linspace(config.beta_start, config.beta_end, n, dtype=torch.float32)
    if config.beta_schedule == "scaled_linear":
        return torch.linspace(config.beta_start**0.5, config.beta_end**0.5, n, dtype=torch.float32) ** 2
    # Cosine: β_t = 1 − ᾱ_t / ᾱ_{t−1}, clipped at 0.999 to avoid the singularity at t = T (Nichol & Dhariwal §3.2).
    values = [min(1 - _cosine_alpha_bar((i + 1) / n) / _cosine_alpha_bar(i / n), 0.999) for i in range(n)]
    return torch.tensor(values, dtype=torch.float32)


def alphas_cumprod(config: NoiseScheduleConfig) -> torch.Tensor:
    """ᾱ_t = ∏_{s≤t} (1 − β_s), shape (T,)."""
    return torch.cumprod(1.0 - betas(config), dim=0)


def spaced_timesteps(config: NoiseScheduleConfig, num_steps: int) -> torch.Tensor:
    """The descending int64 sub-sequence of [0, T) a sampler visits in ``num_steps`` steps, rounded as diffusers
    rounds it (numpy's round-half-to-even)."""
    return torch.from_numpy(_spacing(config, num_steps).round().astype(np.int64))


def _spacing(config: NoiseScheduleConfig, num_steps: int) -> np.ndarray:
    """Descending float64 timesteps before rounding; "leading" and "trailing" are integers already."""
    T = config.num_train_timesteps
    if not 1 <= num_steps <= T:
        raise ValueError(f"num_steps must be in [1, {T}], got {num_steps}")
    if config.timestep_spacing == "linspace":
        return np.linspace(0, T - 1, num_steps)[::-1].copy()
    if config.timestep_spacing == "leading":
        return (np.arange(0, num_steps) * (T // num_steps))[::-1] + float(config.steps_offset)
    # trailing: T−1, T−1−T/n, ... (rounded); the last step lands near t = T/n − 1.
    return np.round(np.arange(T, 0, -T / num_steps)) - 1


def float_timesteps(config: NoiseScheduleConfig, num_steps: int) -> torch.Tensor:
    """Like ``spaced_timesteps`` but float32 and, for "linspace", unrounded: the σ-space samplers (Euler) visit
    fractional timesteps there, as diffusers' do."""
    T = config.num_train_timesteps
    if config.timestep_spacing == "linspace" and 1 <= num_steps <= T:
        return torch.from_numpy(np.linspace(0, T - 1, num_steps, dtype=np.float32)[::-1].copy())
    return spaced_timesteps(config, num_steps).to(torch.float32)


def _expand(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.to(like.device, like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def add_noise(abar: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Sample q(x_t | x_0) with given noise: x_t = √ᾱ_t x_0 + √(1−ᾱ_t) ε (DDPM Eq. 4 reparameterised)."""
    a = _expand(abar[t.cpu()], x0)
    return a.sqrt() * x0 + (1 - a).sqrt() * noise


def velocity(abar: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The v-prediction target v = √ᾱ_t ε − √(1−ᾱ_t) x_0 (Salimans & Ho 2022, §4)."""
    a = _expand(abar[t.cpu()], x0)
    return a.sqrt() * noise - (1 - a).sqrt() * x0


def training_target(config: NoiseScheduleConfig, abar: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor,
                    t: torch.Tensor) -> torch.Tensor:
    """What the denoiser regresses onto: ε itself, or v."""
    return noise if config.prediction_type == "epsilon" else velocity(abar, x0, noise, t)


def predict_x0_eps(config: NoiseScheduleConfig, model_output: torch.Tensor, sample: torch.Tensor,
                   alpha_prod_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x̂_0, ε̂) from the model output at ᾱ_t (DDPM Eq. 15 for ε; for v: x̂_0 = √ᾱ x − √(1−ᾱ) v)."""
    sqrt_a, sqrt_b = alpha_prod_t.sqrt(), (1 - alpha_prod_t).sqrt()
    if config.prediction_type == "epsilon":
        x0 = (sample - sqrt_b * model_output) / sqrt_a
        eps = model_output
    else:
        x0 = sqrt_a * sample - sqrt_b * model_output
        eps = sqrt_a * model_output + sqrt_b * sample
    if config.clip_sample_range is not None:
        x0 = x0.clamp(-config.clip_sample_range, config.clip_sample_range)
    return x0, eps


def step_alphas(
    alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, index: int
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(t, ᾱ_t, ᾱ_{t'}) for the step at ``index``: t' is the next visited timestep, and ᾱ = 1 past the last one."""
    t = int(timesteps[index])
    prev_t = int(timesteps[index + 1]) if index + 1 < len(timesteps) else -1
    abar_prev = alphas_cumprod[prev_t] if prev_t >= 0 else torch.tensor(1.0)
    return t, alphas_cumprod[t], abar_prev


def draw_noise(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """N(0, I) shaped like ``like``, drawn on the generator's device and then moved to ``like``'s (diffusers'
    randn_tensor): a CPU generator gives the same numbers whether the loop runs on the CPU or a GPU."""
    device = generator.device if generator is not None else like.device
    return torch.randn(like.shape, generator=generator, dtype=like.dtype, device=device).to(like.device)
