"""The `vae` application: genserve.v1.Vae (Encode, Decode, Reconstruct) on Ray Serve.

The diffusion app calls `Decode` on this application through a deployment handle, so the two scale apart.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch
from genserve.v1 import common_pb2, vae_pb2
from grpc_health.v1 import health_pb2
from pydantic import Field, field_validator
from ray import serve
from ray.serve.deployment import Application

from services.common import health
from services.common.builder import build_app
from services.common.device import serving_device
from services.common.errors import InvalidArgument
from services.common.images import from_png, images_response, tensor_from_message, tensor_message
from services.common.metrics import ServiceMetrics
from services.common.rpc import unary, unknown_rpcs
from services.common.validation import Request, parse, resolve_seed
from services.vae.model import load_vae

SERVICE = "genserve.v1.Vae"
MAX_IMAGES = 64
MAX_PNG_BYTES = 1 << 20


class ImageIn(Request):
    png: bytes = Field(max_length=MAX_PNG_BYTES)
    width: int = 0
    height: int = 0


class ImagesIn(Request):
    images: list[ImageIn] = Field(min_length=1, max_length=MAX_IMAGES)
    sample: bool = False
    seed: int | None = Field(None, ge=0)


class TensorIn(Request):
    shape: list[int]
    values: list[float]


class DecodeIn(Request):
    latents: TensorIn

    @field_validator("latents")
    @classmethod
    def _sized(cls, latents: TensorIn) -> TensorIn:
        if any(d <= 0 for d in latents.shape) or math.prod(latents.shape) != len(latents.values):
            raise ValueError(f"shape {latents.shape} does not match {len(latents.values)} values")
        if not all(math.isfinite(v) for v in latents.values):
            raise ValueError("values must be finite")
        return latents


@serve.deployment(name="Vae")
class Vae:
    __getattr__ = unknown_rpcs
    def __init__(self, model_dir: str | None):
        self.metrics = ServiceMetrics("vae")
        self.device = serving_device()
        self.vae = load_vae(model_dir, device=self.device)
        self.latent_shape = tuple(self.vae.config.latent_shape)
        self.image_size = self.vae.config.image_size

    def _images(self, images: list[ImageIn]) -> torch.Tensor:
        return torch.stack([from_png(img.png, self.image_size, f"images[{i}].png") for i, img in enumerate(images)])

    def _latents(self, latents: TensorIn) -> torch.Tensor:
        shape = tuple(latents.shape)
        if len(shape) != 4 or shape[1:] != self.latent_shape or not 1 <= shape[0] <= MAX_IMAGES:
            expected = f"(N, {', '.join(map(str, self.latent_shape))}) with N in 1..{MAX_IMAGES}"
            raise InvalidArgument("latents.shape", f"got {list(shape)}, expected {expected}")
        return tensor_from_message(latents.shape, latents.values)

    @unary(vae_pb2.EncodeRequest, vae_pb2.EncodeResponse)
    async def Encode(self, request: vae_pb2.EncodeRequest) -> vae_pb2.EncodeResponse:
        req = parse(ImagesIn, request)
        x = self._images(req.images)  # (N, 3, H, W)
        generator = torch.Generator().manual_seed(resolve_seed(req.seed))

        def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            with torch.inference_mode():
                mean, logvar = (t.cpu() for t in self.vae.encode(x.to(self.device)))  # (N, C, h, w) each
                if not req.sample:
                    return mean, mean, logvar
                eps = torch.randn(mean.shape, generator=generator)
                return mean + torch.exp(0.5 * logvar) * eps, mean, logvar

        latents, mean, logvar = await asyncio.to_thread(run)
        return vae_pb2.EncodeResponse(
            latents=tensor_message(latents),
            mean=tensor_message(mean),
            logvar=tensor_message(logvar),
            scaling_factor=self.vae.scaling_factor,
        )

    @unary(vae_pb2.DecodeRequest, common_pb2.ImagesResponse)
    async def Decode(self, request: vae_pb2.DecodeRequest) -> common_pb2.ImagesResponse:
        z = self._latents(parse(DecodeIn, request).latents)

        def run() -> torch.Tensor:
            with torch.inference_mode():
                return self.vae.decode(z.to(self.device)).cpu()

        images = await asyncio.to_thread(run)
        self.metrics.images("Decode", images.shape[0])
        return images_response(images, seed=0)

    @unary(vae_pb2.ReconstructRequest, common_pb2.ImagesResponse)
    async def Reconstruct(self, request: vae_pb2.ReconstructRequest) -> common_pb2.ImagesResponse:
        x = self._images(parse(ImagesIn, request).images)

        def run() -> torch.Tensor:
            with torch.inference_mode():
                return self.vae.reconstruct(x.to(self.device)).cpu()

        images = await asyncio.to_thread(run)
        self.metrics.images("Reconstruct", images.shape[0])
        return images_response(images, seed=0)

    def downsample_factor(self) -> int:
        """Image pixels per latent cell along each side (a deployment-handle method, not an RPC)."""
        return self.vae.config.downsample_factor

    @unary(health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse)
    async def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        return health.check(request, SERVICE, serving=True)


def build(args: dict[str, Any] | None = None) -> Application:
    return build_app("vae", Vae, args)
