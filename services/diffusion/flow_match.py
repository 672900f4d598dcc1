"""Euler steps on the rectified-flow ODE: diffusers' FlowMatchEulerDiscreteScheduler, the sampler of SD3 and Flux.

Flow matching (Lipman et al. 2023, "Flow Matching for Generative Modeling") with the straight path of rectified flow
(Liu et al. 2023): x_σ = (1 − σ) x_0 + σ ε, and the model predicts the velocity v = ε − x_0, so the ODE
dx/dσ = v is solved by x_{σ'} = x_σ + (σ' − σ) v̂ (Esser et al. 2024, "Scaling Rectified Flow Transformers for
High-Resolution Image Synthesis", eq. 2-3 and §3.1). The timestep the model sees is t = 1000 σ.

Resolution-dependent shifting (Esser et al. 2024, §5.3.2, eq. 23): σ ↦ s σ / (1 + (s − 1) σ) with the folder's
``shift`` s (SD3: 3.0), or, with ``use_dynamic_shifting`` (Flux), σ ↦ e^μ / (e^μ + (1/σ − 1)) with μ linear in the
image's token count between (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift).

diffusers applies the static shift twice on the default path (its __init__ shifts the training σ table, whose end
points set_timesteps spaces between before shifting again); this does the same, so σ matches it step for step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from genserve.shared.checkpoint import supported

CLASS_NAME = "FlowMatchEulerDiscreteScheduler"
SPACINGS = ("default", "linspace")
_OFF = (False,)
# Options diffusers has that this sampler does not implement: refused by name when a folder turns them on.
_FIXED = {"invert_sigmas": _OFF, "shift_terminal": (None,), "use_karras_sigmas": _OFF, "use_exponential_sigmas": _OFF,
          "use_beta_sigmas": _OFF, "time_shift_type": ("exponential",), "stochastic_sampling": _OFF}


@dataclass(frozen=True)
class FlowMatchConfig:
    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096

    def __post_init__(self) -> None:
        if self.num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be >= 1, got {self.num_train_timesteps}")
        if self.shift <= 0:
            raise ValueError(f"shift must be > 0, got {self.shift}")
        if self.max_image_seq_len <= self.base_image_seq_len:
            raise ValueError("max_image_seq_len must exceed base_image_seq_len")

    @classmethod
    def from_diffusers(cls, raw: dict, where: str) -> FlowMatchConfig:
        """A ``scheduler_config.json`` of FlowMatchEulerDiscreteScheduler; an option we do not run is refused."""
        for key, allowed in _FIXED.items():
            supported(raw, key, allowed[0], allowed, where)
        return cls(num_train_timesteps=int(raw.get("num_train_timesteps", 1000)), shift=float(raw.get("shift", 1.0)),
                   use_dynamic_shifting=bool(raw.get("use_dynamic_shifting", False)),
                   base_shift=float(raw.get("base_shift") or 0.5), max_shift=float(raw.get("max_shift") or 1.15),
                   base_image_seq_len=int(raw.get("base_image_seq_len", 256)),
                   max_image_seq_len=int(raw.get("max_image_seq_len", 4096)))

    def mu(self, image_seq_len: int) -> float:
        """The dynamic shift's μ for an image of ``image_seq_len`` tokens (diffusers' calculate_shift)."""
        m = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
        return image_seq_len * m + (self.base_shift - m * self.base_image_seq_len)


class FlowMatchEulerScheduler:
    """The samplers' interface (services/diffusion/schedulers/__init__.py) over σ from 1 to 0: ``set_timesteps``,
    ``init_noise_sigma`` (1: the first sample is pure noise), ``scale_model_input`` (the identity), ``step``."""

    def __init__(self, config: FlowMatchConfig, image_seq_len: int = 256, spacing: str = "default") -> None:
        if spacing not in SPACINGS:
            raise ValueError(f"spacing must be one of {SPACINGS}, got {spacing!r}")
        self.config = config
        self.image_seq_len = image_seq_len
        self.spacing = spacing  # "linspace": σ = linspace(1, 1/n, n) before shifting, as FluxPipeline passes them
        self.set_timesteps(10)

    def _shift(self, sigmas: np.ndarray) -> np.ndarray:
        c = self.config
        if c.use_dynamic_shifting:
            mu = c.mu(self.image_seq_len)
            return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))
        return c.shift * sigmas / (1 + (c.shift - 1) * sigmas)

    def set_timesteps(self, num_steps: int) -> torch.Tensor:
        """σ_0 > … > σ_{n−1} shifted, then σ_n = 0; the timesteps are 1000 σ_i (float32, as diffusers')."""
        c, n = self.config, num_steps
        if self.spacing == "linspace":
            sigmas = np.linspace(1.0, 1 / n, n).astype(np.float32)
        else:
            # The training table's ends, shifted as diffusers' __init__ shifts them (static shift only).
            table = np.linspace(1, c.num_train_timesteps, c.num_train_timesteps, dtype=np.float32)[::-1] / \
                c.num_train_timesteps
            table = torch.from_numpy(table.copy()).float()
            if not c.use_dynamic_shifting:
                table = c.shift * table / (1 + (c.shift - 1) * table)
            sigma_max, sigma_min = table[0].item(), table[-1].item()
            sigmas = np.linspace(sigma_max * c.num_train_timesteps, sigma_min * c.num_train_timesteps, n) / \
                c.num_train_timesteps
        sigmas = torch.from_numpy(np.asarray(self._shift(sigmas))).float()
        self.sigmas = torch.cat([sigmas, torch.zeros(1)])
        self.timesteps = sigmas * c.num_train_timesteps
        return self.timesteps

    @property
    def init_noise_sigma(self) -> float:
        return 1.0

    def scale_model_input(self, sample: torch.Tensor, index: int) -> torch.Tensor:
        return sample

    def step(self, model_output: torch.Tensor, index: int, sample: torch.Tensor,
             generator: torch.Generator | None = None) -> torch.Tensor:
        """x at σ_index → x at σ_{index+1} = x + (σ_{index+1} − σ_index) v̂ (Esser et al. 2024, eq. 2), in float32;
        ``generator`` is accepted for the common interface and unused (the ODE is deterministic)."""
        dt = self.sigmas[index + 1] - self.sigmas[index]
        return (sample.float() + dt * model_output.float()).to(model_output.dtype)

    def scale_noise(self, x0: torch.Tensor, noise: torch.Tensor, index: int) -> torch.Tensor:
        """The forward process at σ_index: (1 − σ) x_0 + σ ε, the start of image-to-image (diffusers' scale_noise)."""
        sigma = self.sigmas[index]
        return sigma * noise + (1.0 - sigma) * x0
