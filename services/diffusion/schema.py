"""The diffusion service's wire schema: what a DiffusionRequest may hold once validated, with the one set of limits
that the gRPC handler (services/diffusion/app.py) and the HTTP ingress (services/http) apply, and the errors each
maps to a status. Torch-free: the ingress imports it without the model code."""

from __future__ import annotations

import re

import grpc
from pydantic import Field, ValidationInfo, field_validator
from ray.serve.exceptions import BackPressureError

from genserve.services.common.validation import Request
from genserve.services.diffusion.params import (
    DEFAULT_GUIDANCE_SCALE,
    DEFAULT_STEPS,
    GUIDANCE_MODES,
    LORA_NAME,
    MAX_GUIDANCE_SCALE,
    MAX_LORA_SCALE,
    MAX_NEGATIVE_WEIGHT,
    MAX_PROMPT_CHARS,
    MAX_STEPS,
    SCHEDULERS,
    GenerationCancelled,
    LoraNotFound,
)
from genserve.shared.seeds import MAX_SEED

# One request holds a slot in the loop for all its steps; a small batch keeps the queue moving.
MAX_IMAGES = 8
# An edit's init_image and mask, each (PNG or JPEG, at most 1024x1024 pixels: services/diffusion/edit_inputs.py).
MAX_EDIT_BYTES = 8 * 1024 * 1024
# U-Net rows of the largest request: MAX_IMAGES images × 3 passes (Perp-Neg with a negative prompt).
MAX_REQUEST_ROWS = 3 * MAX_IMAGES

# The request fields that name one of a fixed set ("" = the model's default): what the error calls it, the names.
_NAMED_CHOICES = {"guidance": ("guidance mode", GUIDANCE_MODES), "scheduler": ("scheduler", tuple(sorted(SCHEDULERS)))}


class DiffusionIn(Request):
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    negative_prompt: str = Field("", max_length=MAX_PROMPT_CHARS)
    num_images: int = Field(1, ge=1, le=MAX_IMAGES)
    steps: int = Field(DEFAULT_STEPS, ge=1, le=MAX_STEPS)
    guidance_scale: float = Field(DEFAULT_GUIDANCE_SCALE, ge=0, le=MAX_GUIDANCE_SCALE, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    scheduler: str = ""
    eta: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    preview_every: int = Field(0, ge=0, le=MAX_STEPS)
    width: int | None = Field(None, ge=1)
    height: int | None = Field(None, ge=1)
    guidance: str = ""
    negative_weight: float | None = Field(None, ge=0, le=MAX_NEGATIVE_WEIGHT, allow_inf_nan=False)
    init_image: bytes = Field(b"", max_length=MAX_EDIT_BYTES)
    strength: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    mask: bytes = Field(b"", max_length=MAX_EDIT_BYTES)
    cache_threshold: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)  # services/diffusion/step_cache.py
    lora: str = ""  # a LoRA loaded on the server (services/diffusion/loras.py); "": none
    lora_scale: float | None = Field(None, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE, allow_inf_nan=False)

    @field_validator("lora")
    @classmethod
    def _lora_name(cls, name: str) -> str:
        if name and not re.fullmatch(LORA_NAME, name):
            raise ValueError("a LoRA name is 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return name

    @field_validator("lora_scale")
    @classmethod
    def _scale_needs_a_lora(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and not info.data.get("lora"):
            raise ValueError("needs a lora")
        return value

    @field_validator("strength", "mask")
    @classmethod
    def _edit_needs_an_image(cls, value: float | bytes | None, info: ValidationInfo) -> float | bytes | None:
        if value not in (b"", None) and not info.data.get("init_image"):
            raise ValueError("needs an init_image (image-to-image and inpainting start from one)")
        return value

    @property
    def edit_strength(self) -> float:
        """The request's strength, else diffusers' default: 1.0 for inpainting, 0.8 for image-to-image."""
        return self.strength if self.strength is not None else (1.0 if self.mask else 0.8)

    @field_validator("guidance", "scheduler")
    @classmethod
    def _known_name(cls, name: str, info: ValidationInfo) -> str:
        kind, names = _NAMED_CHOICES[info.field_name]
        if name and name not in names:
            raise ValueError(f"unknown {kind} {name!r}; one of {', '.join(names)}")
        return name


# BackPressureError: the `vae` application's queue is full, so this request cannot be decoded now.
KNOWN_ERRORS: dict[type[Exception], tuple[grpc.StatusCode, str | None]] = {
    GenerationCancelled: (grpc.StatusCode.CANCELLED, None),
    LoraNotFound: (grpc.StatusCode.NOT_FOUND, "lora"),
    BackPressureError: (grpc.StatusCode.RESOURCE_EXHAUSTED, None),
}
