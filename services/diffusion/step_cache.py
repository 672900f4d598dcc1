"""Step caching for diffusion transformers: FirstBlockCache (the "first block cache" of ParaAttention and Cache-DiT,
diffusers' FirstBlockCacheConfig; after TeaCache, Liu et al. 2025, "Timestep Embedding Tells: It's Time to Cache
for Video Diffusion Model", §3: reuse the expensive part of a step when a cheap probe says the step changed little).

At each step the first block runs; its residual r₁ = block₀(x) − x is the probe. When
‖r₁ − r₁_prev‖₁ / ‖r₁_prev‖₁ < threshold, the remaining blocks are skipped and their residual from the last full
step is added instead: x_L ≈ block₀(x) + (x_L − x₁)_prev. Otherwise every block runs and that residual is stored.
Consecutive flow-matching steps of a DiT change slowly in the middle of the schedule, so most steps there are
skipped; the first steps (large changes) always run in full.

One cache belongs to one request (its rows, its steps): it rides on the request's TextConditioning, and the step
batcher gives a cached request a denoiser call of its own. It is a runtime object, not part of the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# The relative L1 change of the first block's residual below which a step reuses the rest: ParaAttention's value for
# FLUX.1-dev, not measured here. Random-weight pipelines change 0.18-0.44 per step at 28 steps (measured on
# tests/services/diffusion/tiny_sd3.py's), so they skip nothing at it (docs/models.md, "Step caching").
DEFAULT_CACHE_THRESHOLD = 0.08
MAX_CACHE_THRESHOLD = 1.0


@dataclass
class FirstBlockCache:
    threshold: float = DEFAULT_CACHE_THRESHOLD
    skipped: int = 0  # steps whose remaining blocks were skipped
    steps: int = 0
    _first: torch.Tensor | None = field(default=None, repr=False)  # r₁ of the previous step
    _rest: torch.Tensor | None = field(default=None, repr=False)  # x_L − x₁ of the last full step

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= MAX_CACHE_THRESHOLD:
            raise ValueError(f"cache_threshold must be in (0, {MAX_CACHE_THRESHOLD}], got {self.threshold}")

    def _similar(self, first: torch.Tensor) -> bool:
        if self._first is None or self._rest is None or self._first.shape != first.shape:
            return False
        change = (first - self._first).abs().mean() / self._first.abs().mean().clamp_min(1e-12)
        return bool(change < self.threshold)

    def run(self, model, x: torch.Tensor, c: torch.Tensor, y: torch.Tensor,
            head: Callable[[torch.Tensor], torch.Tensor], rotary=None) -> torch.Tensor:
        """One denoiser call through ``model.first_block`` and, unless skipped, ``model.run_blocks(start=1)``."""
        x1, c1 = model.first_block(x, c, y, rotary)
        first = x1 - x
        self.steps += 1
        if self._similar(first):
            self.skipped += 1
            out = x1 + self._rest
        else:
            out = model.run_blocks(x1, c1, y, rotary, start=1)
            self._rest = out - x1
        self._first = first
        return head(out)
