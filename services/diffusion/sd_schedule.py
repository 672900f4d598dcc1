"""A diffusers ``scheduler/scheduler_config.json`` as the noise schedule each of our samplers runs with.

diffusers switches samplers with ``XScheduler.from_config(pipe.scheduler.config)``: keys the folder's config holds
carry over, and keys it lacks take the new class's defaults (DDIM and DDPM space timesteps "leading" and clip x̂_0
at 1 by default; DPM-Solver++ and Euler space them "linspace"). ``schedule_for`` does the same, so each sampler
visits the timesteps diffusers' would. Options we do not implement are refused with the key named.
"""

from __future__ import annotations

from genserve.services.diffusion.schedulers.schedule import (
    BETA_SCHEDULES,
    PREDICTION_TYPES,
    TIMESTEP_SPACINGS,
    NoiseScheduleConfig,
)
from genserve.shared.checkpoint import supported

# The scheduler classes whose config is a beta schedule our samplers can read; the name picks the default sampler.
SCHEDULER_CLASSES = {
    "DDIMScheduler": "ddim", "DDPMScheduler": "ddpm", "PNDMScheduler": "ddim", "LMSDiscreteScheduler": "euler",
    "EulerDiscreteScheduler": "euler", "EulerAncestralDiscreteScheduler": "euler",
    "DPMSolverMultistepScheduler": "dpmpp_2m",
}
# Per sampler: diffusers' class defaults for the keys that differ between classes.
_DEFAULTS = {
    "ddim": {"timestep_spacing": "leading", "clip_sample": True},
    "ddpm": {"timestep_spacing": "leading", "clip_sample": True},
    "dpmpp_2m": {"timestep_spacing": "linspace", "clip_sample": False},
    "euler": {"timestep_spacing": "linspace", "clip_sample": False},
}
# Per sampler: the values each option may take (the first is diffusers' default); the sampler implements only these.
_OFF = (False,)
_FIXED = {
    "ddim": {"thresholding": _OFF},
    "ddpm": {"thresholding": _OFF, "variance_type": ("fixed_small",)},
    "dpmpp_2m": {"thresholding": _OFF, "algorithm_type": ("dpmsolver++",), "solver_order": (2,),
                 "solver_type": ("midpoint",), "lower_order_final": (True,), "euler_at_final": _OFF,
                 "use_karras_sigmas": _OFF, "use_exponential_sigmas": _OFF, "use_beta_sigmas": _OFF,
                 "use_lu_lambdas": _OFF, "use_flow_sigmas": _OFF, "final_sigmas_type": ("zero",),
                 "variance_type": (None, "fixed_small", "fixed_large"), "lambda_min_clipped": (float("-inf"),)},
    "euler": {"interpolation_type": ("linear",), "use_karras_sigmas": _OFF, "use_exponential_sigmas": _OFF,
              "use_beta_sigmas": _OFF, "timestep_type": ("discrete",), "final_sigmas_type": ("zero",)},
}


def check_scheduler_config(raw: dict, where: str) -> None:
    """Refuse what no sampler can honour: trained betas, zero-terminal-SNR rescaling, other schedules."""
    supported(raw, "trained_betas", None, (None,), where)
    supported(raw, "rescale_betas_zero_snr", False, (False,), where)
    supported(raw, "beta_schedule", "linear", BETA_SCHEDULES, where)
    supported(raw, "prediction_type", "epsilon", PREDICTION_TYPES, where)
    if "timestep_spacing" in raw:
        supported(raw, "timestep_spacing", None, TIMESTEP_SPACINGS, where)


def schedule_for(raw: dict, sampler: str, where: str) -> NoiseScheduleConfig:
    """The NoiseScheduleConfig that diffusers' class for ``sampler`` would build from this config. Keys listed in
    ``_use_default_values`` (an in-memory config's record of what its class defaulted) count as absent, as they do
    in diffusers' from_config."""
    defaulted = set(raw.get("_use_default_values", ()))
    raw = {k: v for k, v in raw.items() if k not in defaulted}
    check_scheduler_config(raw, where)
    for key, allowed in _FIXED[sampler].items():
        supported(raw, key, allowed[0], allowed, f"{where} (for the {sampler} sampler)")
    defaults = _DEFAULTS[sampler]
    clip = raw.get("clip_sample", defaults["clip_sample"])
    return NoiseScheduleConfig(
        num_train_timesteps=int(raw.get("num_train_timesteps", 1000)),
        beta_start=float(raw.get("beta_start", 0.0001)), beta_end=float(raw.get("beta_end", 0.02)),
        beta_schedule=raw.get("beta_schedule") or "linear", prediction_type=raw.get("prediction_type") or "epsilon",
        timestep_spacing=raw.get("timestep_spacing") or defaults["timestep_spacing"],
        steps_offset=int(raw.get("steps_offset", 0)), set_alpha_to_one=bool(raw.get("set_alpha_to_one", True)),
        clip_sample_range=float(raw.get("clip_sample_range", 1.0)) if clip and sampler in ("ddim", "ddpm") else None,
    )
