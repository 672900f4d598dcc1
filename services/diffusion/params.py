"""What a diffusion request may ask for: the limits and defaults of a generation, the guidance modes and samplers by
name, and the error a cancelled generation raises. Torch-free, so the wire schema (services/diffusion/schema.py) and
the HTTP ingress load it without the model code."""

from __future__ import annotations

MAX_STEPS = 200
# Prompts per pipeline call (the evaluation batches this many); one request asks for at most schema.MAX_IMAGES.
MAX_BATCH = 16
MAX_GUIDANCE_SCALE = 20.0
MAX_PROMPT_CHARS = 200
MAX_NEGATIVE_WEIGHT = 10.0
DEFAULT_STEPS = 20
DEFAULT_GUIDANCE_SCALE = 3.0
GUIDANCE_MODES = ("cfg", "perp_neg")  # services/diffusion/guidance.py
DEFAULT_NEGATIVE_WEIGHT = 1.0
SCHEDULERS = ("ddpm", "ddim", "dpmpp_2m", "euler")  # services/diffusion/schedulers/


class GenerationCancelled(Exception):
    """Raised by ``DiffusionPipeline.generate`` when ``should_cancel()`` returned True between two steps."""
