"""Euler's method on the probability-flow ODE in σ space (Karras et al. 2022, Algorithm 1 with γ = 0): diffusers'
EulerDiscreteScheduler, the "Euler" sampler of Stable Diffusion front ends.

With σ_t = √((1 − ᾱ_t) / ᾱ_t) the sample is x = x_0 + σ ε (not the variance-preserving x_t of DDPM), so the first
sample is N(0, σ_max² I) and the model, trained on x_t = x / √(σ² + 1), sees its input rescaled by that factor.
"""

from __future__ import annotations

import numpy as np
import torch

from genserve.services.diffusion.schedulers.schedule import NoiseScheduleConfig, alphas_cumprod, float_timesteps


class EulerDiscreteScheduler:
    """Deterministic first-order steps x_{i+1} = x_i + (σ_{i+1} − σ_i) d_i, d_i = (x_i − x̂_0) / σ_i (Karras Eq. 4)."""

    def __init__(self, config: NoiseScheduleConfig) -> None:
        self.config = config
        self.alphas_cumprod = alphas_cumprod(config)
        self.set_timesteps(10)

    def set_timesteps(self, num_steps: int) -> torch.Tensor:
        """Timesteps (float32: "linspace" visits fractional ones) and σ at each, interpolated linearly in t, then
        σ = 0 after the last step."""
        self.timesteps = float_timesteps(self.config, num_steps)
        abar = self.alphas_cumprod
        train_sigmas = (((1 - abar) / abar) ** 0.5).numpy()  # (T,), float32 like diffusers' table
        sigmas = np.interp(self.timesteps.numpy(), np.arange(len(train_sigmas)), train_sigmas)
        self.sigmas = torch.from_numpy(np.concatenate([sigmas, [0.0]]).astype(np.float32))
        return self.timesteps

    @property
    def init_noise_sigma(self) -> float:
        """Std of the first sample: σ_max, or √(σ_max² + 1) for "leading" (diffusers' convention)."""
        max_sigma = float(self.sigmas.max())
        if self.config.timestep_spacing in ("linspace", "trailing"):
            return max_sigma
        return (max_sigma**2 + 1) ** 0.5

    def scale_model_input(self, sample: torch.Tensor, index: int) -> torch.Tensor:
        """x / √(σ² + 1): the variance-preserving x_t the model was trained on."""
        return sample / ((self.sigmas[index] ** 2 + 1) ** 0.5)

    def step(self, model_output: torch.Tensor, index: int, sample: torch.Tensor,
             generator: torch.Generator | None = None) -> torch.Tensor:
        """x at σ_index → x at σ_{index+1}; ``generator`` is accepted for a uniform sampler interface and unused."""
        sigma = self.sigmas[index]
        # 1. x̂_0 from the model output (ε: x − σ ε; v: the c_skip / c_out form of Karras Table 1 for v).
        if self.config.prediction_type == "epsilon":
            x0 = sample - sigma * model_output
        else:
            x0 = model_output * (-sigma / (sigma**2 + 1) ** 0.5) + sample / (sigma**2 + 1)
        # 2. The ODE derivative dx/dσ = (x − x̂_0) / σ, and one Euler step to σ_{i+1}.
        derivative = (sample - x0) / sigma
        return sample + derivative * (self.sigmas[index + 1] - sigma)
