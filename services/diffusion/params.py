"""What a diffusion request may ask for: the limits and defaults of a generation, the guidance modes and samplers by
name, LoRA names and scales, and the errors a cancelled generation and LoRAs raise. Torch-free, so the wire schema
(services/diffusion/schema.py) and the HTTP ingress load it without the model code."""

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
# A LoRA's name (services/diffusion/loras.py): what a request's `lora` field and the serve config call it.
LORA_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
# A request's LoRA scale: diffusers' `cross_attention_kwargs={"scale": s}`; negative values invert a LoRA (sliders).
MAX_LORA_SCALE = 10.0


class GenerationCancelled(Exception):
    """Raised by ``DiffusionPipeline.generate`` when ``should_cancel()`` returned True between two steps."""


class LoraNotFound(LookupError):
    """A request (or an unload) names a LoRA this replica has not loaded: NOT_FOUND, naming it."""


class InvalidLora(ValueError):
    """A LoRA that cannot be loaded: a bad name, a path outside the root, or a file that does not fit the pipeline
    (the message names the tensor and the shape expected)."""


class LoraCapacityExceeded(Exception):
    """Loading one more LoRA would pass the replica's `max_loras`."""
