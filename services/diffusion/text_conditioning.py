"""What a diffusion transformer reads from the prompt, fixed for a request's whole denoising: the per-token text
states, a pooled vector (SD3: both CLIPs' pooled outputs; Flux: CLIP-L's) and, for guidance-distilled models
(Flux), the guidance scale per row. A `ContextCache`, so the pipeline, the Denoising state and the step batcher carry
it where a U-Net's cross-attention context goes; the batcher's StackedContext of several is read back by `gather`.
"""

from __future__ import annotations

import torch

from genserve.shared.blocks.cross_attention import ContextCache


class TextConditioning(ContextCache):
    def __init__(self, tokens: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor | None = None) -> None:
        super().__init__(tokens)  # (B, T, D): ``.context``, which the batcher groups requests by
        self.pooled = pooled  # (B, P)
        self.guidance = guidance  # (B,) or None
        self.step_cache = None  # this request's FirstBlockCache (services/diffusion/step_cache.py), if it asked



def gather(context: ContextCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(tokens (B, T, D), pooled (B, P), guidance (B,) or None) of one TextConditioning or of the step batcher's
    stack of several (its ``caches``, in row order)."""
    parts = getattr(context, "caches", None) or [context]
    if not all(isinstance(part, TextConditioning) for part in parts):
        raise TypeError("a diffusion transformer needs TextConditioning (tokens and a pooled vector) as its context")
    tokens = torch.cat([p.context for p in parts]) if len(parts) > 1 else parts[0].context
    pooled = torch.cat([p.pooled for p in parts]) if len(parts) > 1 else parts[0].pooled
    guidance = None if parts[0].guidance is None else torch.cat([p.guidance for p in parts])
    return tokens, pooled, guidance
