"""Samplers for the reverse diffusion process, one per file, all sharing ``schedule.NoiseScheduleConfig``.

Every sampler has ``set_timesteps(n) -> timesteps``, ``init_noise_sigma`` (the std of the first sample),
``scale_model_input(sample, index)`` (what the model sees) and ``step(model_output, index, sample, generator) ->
sample``, where ``index`` is the position in ``timesteps``. ``make_scheduler`` builds one by name.
"""

from __future__ import annotations

from genserve.services.diffusion.params import SCHEDULERS
from genserve.services.diffusion.schedulers.ddim import DDIMScheduler
from genserve.services.diffusion.schedulers.ddpm import DDPMScheduler
from genserve.services.diffusion.schedulers.dpm_solver import DPMSolverMultistepScheduler
from genserve.services.diffusion.schedulers.euler import EulerDiscreteScheduler
from genserve.services.diffusion.schedulers.schedule import NoiseScheduleConfig

Scheduler = DDPMScheduler | DDIMScheduler | DPMSolverMultistepScheduler | EulerDiscreteScheduler


def make_scheduler(name: str, config: NoiseScheduleConfig, eta: float = 0.0) -> Scheduler:
    """A fresh sampler; ``eta`` only applies to DDIM (DDPM is η = 1 by construction, DPM-Solver++ and Euler solve
    the ODE)."""
    if name == "ddpm":
        return DDPMScheduler(config)
    if name == "ddim":
        return DDIMScheduler(config, eta=eta)
    if name == "dpmpp_2m":
        return DPMSolverMultistepScheduler(config)
    if name == "euler":
        return EulerDiscreteScheduler(config)
    raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {name!r}")


__all__ = ["SCHEDULERS", "DDIMScheduler", "DDPMScheduler", "DPMSolverMultistepScheduler", "EulerDiscreteScheduler",
           "NoiseScheduleConfig", "make_scheduler"]
