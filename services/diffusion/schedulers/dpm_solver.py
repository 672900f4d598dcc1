"""DPM-Solver++(2M): the multistep second-order solver of the diffusion ODE in data prediction (Lu et al. 2022b).

With λ_t = log(α_t / σ_t) (half log-SNR; α_t = √ᾱ_t, σ_t = √(1−ᾱ_t)) and h = λ_t − λ_s, the exact solution of the
ODE in x_θ form is x_t = (σ_t/σ_s) x_s + σ_t ∫ e^λ x_θ dλ. Algorithm 2 of the paper approximates the integrand with
the last two data predictions; its first step (no history) and, when the schedule ends at σ = 0, its last step are
the first-order DPM-Solver++(1) update, which equals DDIM.
"""

from __future__ import annotations

import torch

from genserve.services.diffusion.schedulers.schedule import (
    NoiseScheduleConfig,
    alphas_cumprod,
    predict_x0_eps,
    spaced_timesteps,
)


class DPMSolverMultistepScheduler:
    """DPM-Solver++(2M), deterministic; holds the previous x_θ between calls, so one instance runs one loop."""

    def __init__(self, config: NoiseScheduleConfig) -> None:
        self.config = config
        self.alphas_cumprod = alphas_cumprod(config)
        self.init_noise_sigma = 1.0
        self.set_timesteps(10)

    def set_timesteps(self, num_steps: int) -> torch.Tensor:
        """diffusers' DPM-Solver spaces "leading" and "linspace" over n + 1 points and drops the last (t = 0 or
        the offset); "trailing" is the usual one."""
        if self.config.timestep_spacing == "trailing":
            self.timesteps = spaced_timesteps(self.config, num_steps)
        else:
            self.timesteps = spaced_timesteps(self.config, num_steps + 1)[:-1]
        abar = self.alphas_cumprod[self.timesteps]
        # The schedule ends at σ = 0 (α = 1): the last step returns the data prediction itself.
        self.alpha = torch.cat([abar.sqrt(), torch.ones(1)])
        self.sigma = torch.cat([(1 - abar).sqrt(), torch.zeros(1)])
        self.lambdas = torch.log(self.alpha) - torch.log(self.sigma)  # λ = +inf at the end
        self._previous_x0: torch.Tensor | None = None
        return self.timesteps

    def scale_model_input(self, sample: torch.Tensor, index: int) -> torch.Tensor:
        """DPM-Solver feeds x_t to the model as it is."""
        return sample

    def step(self, model_output: torch.Tensor, index: int, sample: torch.Tensor,
             generator: torch.Generator | None = None) -> torch.Tensor:
        """x_{t_{i}} → x_{t_{i+1}}; ``generator`` is accepted for a uniform sampler interface and unused."""
        s, t = index, index + 1
        # 1. Data prediction x_θ(x_s, s) (the "++" of DPM-Solver++: solve in x_0 space, §4).
        x0, _ = predict_x0_eps(self.config, model_output, sample, self.alpha[s] ** 2)
        h = self.lambdas[t] - self.lambdas[s]
        phi = torch.expm1(-h)  # e^{−h} − 1
        last = t == len(self.timesteps)
        if self._previous_x0 is None or last:
            # 2a. First order (Algorithm 2, first step): x_t = (σ_t/σ_s) x_s − α_t (e^{−h} − 1) x_θ.
            prev = (self.sigma[t] / self.sigma[s]) * sample - self.alpha[t] * phi * x0
        else:
            # 2b. Second order (Algorithm 2, loop): r = h_{i−1}/h_i, D = (1 + 1/2r) x_θ,i − (1/2r) x_θ,i−1.
            r = (self.lambdas[s] - self.lambdas[s - 1]) / h
            d = x0 + (0.5 / r) * (x0 - self._previous_x0)
            prev = (self.sigma[t] / self.sigma[s]) * sample - self.alpha[t] * phi * d
        self._previous_x0 = x0
        return prev
