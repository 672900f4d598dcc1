"""DDPM ancestral sampling (Ho et al. 2020, Algorithm 2), on a strided sub-sequence of timesteps."""

from __future__ import annotations

import torch

from genserve.services.diffusion.schedulers.schedule import (
    NoiseScheduleConfig,
    alphas_cumprod,
    draw_noise,
    predict_x0_eps,
    spaced_timesteps,
    step_alphas,
)


class DDPMScheduler:
    """Stochastic reverse process with the posterior variance β̃_t ("fixed_small")."""

    def __init__(self, config: NoiseScheduleConfig) -> None:
        self.config = config
        self.alphas_cumprod = alphas_cumprod(config)
        self.timesteps = spaced_timesteps(config, config.num_train_timesteps)
        self.init_noise_sigma = 1.0

    def set_timesteps(self, num_steps: int) -> torch.Tensor:
        self.timesteps = spaced_timesteps(self.config, num_steps)
        return self.timesteps

    def scale_model_input(self, sample: torch.Tensor, index: int) -> torch.Tensor:
        """DDPM feeds x_t to the model as it is."""
        return sample

    def step(self, model_output: torch.Tensor, index: int, sample: torch.Tensor,
             generator: torch.Generator | None = None) -> torch.Tensor:
        """x_t → x_{t'} where t = timesteps[index] and t' the next visited timestep (or "before 0")."""
        t, abar_t, abar_prev = step_alphas(self.alphas_cumprod, self.timesteps, index)
        # Striding replaces the one-step α_t by ᾱ_t / ᾱ_{t'}, so β_t becomes 1 − ᾱ_t / ᾱ_{t'}.
        alpha_t = abar_t / abar_prev
        beta_t = 1 - alpha_t

        # 1. x̂_0 from the model output (Eq. 15).
        x0, _ = predict_x0_eps(self.config, model_output, sample, abar_t)
        # 2. Posterior mean μ̃_t(x_t, x̂_0) (Eq. 7).
        x0_coeff = abar_prev.sqrt() * beta_t / (1 - abar_t)
        xt_coeff = alpha_t.sqrt() * (1 - abar_prev) / (1 - abar_t)
        mean = x0_coeff * x0 + xt_coeff * sample
        if t == 0:
            return mean
        # 3. Posterior variance β̃_t = (1 − ᾱ_{t'}) / (1 − ᾱ_t) · β_t (Eq. 7), then x_{t'} = μ̃ + √β̃ z.
        variance = torch.clamp((1 - abar_prev) / (1 - abar_t) * beta_t, min=1e-20)
        return mean + variance.sqrt() * draw_noise(model_output, generator)
