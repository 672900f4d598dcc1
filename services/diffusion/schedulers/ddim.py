"""DDIM sampling (Song et al. 2021), deterministic at η = 0 and DDPM-like at η = 1."""

from __future__ import annotations

import torch

from genserve.services.diffusion.schedulers.schedule import (
    NoiseScheduleConfig,
    alphas_cumprod,
    draw_noise,
    predict_x0_eps,
    spaced_timesteps,
)


class DDIMScheduler:
    """The generalised non-Markovian reverse process of DDIM Eq. 12 with σ_t(η) from Eq. 16."""

    def __init__(self, config: NoiseScheduleConfig, eta: float = 0.0) -> None:
        if eta < 0:
            raise ValueError(f"eta must be >= 0, got {eta}")
        self.config = config
        self.eta = eta
        self.alphas_cumprod = alphas_cumprod(config)
        # ᾱ past the last step: 1 lands on x̂_0 itself; Stable Diffusion 1.x configs keep ᾱ_0.
        self.final_alpha_cumprod = torch.tensor(1.0) if config.set_alpha_to_one else self.alphas_cumprod[0]
        self.timesteps = spaced_timesteps(config, config.num_train_timesteps)
        self.init_noise_sigma = 1.0

    def set_timesteps(self, num_steps: int) -> torch.Tensor:
        self.timesteps = spaced_timesteps(self.config, num_steps)
        return self.timesteps

    def scale_model_input(self, sample: torch.Tensor, index: int) -> torch.Tensor:
        """DDIM feeds x_t to the model as it is."""
        return sample

    def step(self, model_output: torch.Tensor, index: int, sample: torch.Tensor,
             generator: torch.Generator | None = None) -> torch.Tensor:
        """x_t → x_{t'} where t = timesteps[index] and t' = t − T/n (diffusers' rule, the next visited timestep for
        evenly spaced ones); past t = 0 it lands on ``final_alpha_cumprod``. Noise (η > 0) is drawn on the
        generator's device, then moved, so a CPU generator gives the same draws on every device."""
        t = int(self.timesteps[index])
        prev_t = t - self.config.num_train_timesteps // len(self.timesteps)
        abar_t = self.alphas_cumprod[t]
        abar_prev = self.alphas_cumprod[prev_t] if prev_t >= 0 else self.final_alpha_cumprod

        # 1. "predicted x_0" and the ε it implies (Eq. 12, first term; Eq. 9 inverted).
        x0, eps = predict_x0_eps(self.config, model_output, sample, abar_t)
        # 2. σ_t(η) = η √((1 − ᾱ_{t'}) / (1 − ᾱ_t)) √(1 − ᾱ_t / ᾱ_{t'}) (Eq. 16).
        variance = (1 - abar_prev) / (1 - abar_t) * (1 - abar_t / abar_prev)
        std = self.eta * variance.sqrt()
        # 3. "direction pointing to x_t" (Eq. 12, second term).
        direction = (1 - abar_prev - std**2).sqrt() * eps
        # 4. x_{t'} = √ᾱ_{t'} x̂_0 + direction + σ_t z (Eq. 12).
        prev = abar_prev.sqrt() * x0 + direction
        if self.eta > 0:
            prev = prev + std * draw_noise(model_output, generator)
        return prev
