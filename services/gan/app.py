"""The `gan` application: genserve.v1.ImageGan (Sample, Interpolate) on Ray Serve.

Both RPCs draw their latents from their own seeds, then share one batcher (services/common/batcher.py): concurrent
requests become one generator call of up to `max_batch_images` images (serve config args), and each gets back
exactly the images it would have got alone (the generator is batch-invariant, tests/services/gan).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from grpc_health.v1 import health_pb2
from pydantic import Field
from ray import serve
from ray.serve.deployment import Application

from genserve.services.common import health
from genserve.services.common.batcher import BatchArgs, Batcher
from genserve.services.common.builder import build_app
from genserve.services.common.device import serving_device, use_torch_threads
from genserve.services.common.gate import Gate
from genserve.services.common.gc_freeze import freeze_loaded_objects
from genserve.services.common.images import images_response
from genserve.services.common.metrics import ServiceMetrics
from genserve.services.common.rpc import unary, unknown_rpcs
from genserve.services.common.validation import Request, parse
from genserve.services.gan.model import load_generator
from genserve.services.gan.sampling import generate, sample_latents, slerp
from genserve.shared.seeds import resolve_seed
from genserve.v1 import common_pb2, gan_pb2

SERVICE = "genserve.v1.ImageGan"
MAX_IMAGES = 64
# The truncation trick redraws latent entries with |z| > truncation: below ~0.1 almost every draw is redone.
MIN_TRUNCATION = 0.1
MAX_TRUNCATION = 4.0


class SampleIn(Request):
    num_images: int = Field(1, ge=1, le=MAX_IMAGES)
    seed: int | None = Field(None, ge=0)
    truncation: float | None = Field(None, ge=MIN_TRUNCATION, le=MAX_TRUNCATION, allow_inf_nan=False)


class InterpolateIn(Request):
    seed_start: int = Field(0, ge=0)
    seed_end: int = Field(0, ge=0)
    steps: int = Field(8, ge=2, le=MAX_IMAGES)
    truncation: float | None = Field(None, ge=MIN_TRUNCATION, le=MAX_TRUNCATION, allow_inf_nan=False)


@serve.deployment(name="ImageGan")
class ImageGan:
    __getattr__ = unknown_rpcs

    def __init__(self, model_dir: str | None, args: BatchArgs):
        use_torch_threads(args.torch_threads)
        self.metrics = ServiceMetrics("gan")
        self.gate = Gate.from_env(args.rate_limits)
        self.generator = load_generator(model_dir, device=serving_device())
        self.z_dim = self.generator.config.z_dim
        self.batcher = Batcher(self._generate_batch, len, args.max_batch_images, args.batch_wait_s,
                               lambda images, waits: self.metrics.batch("generate", images, waits))
        freeze_loaded_objects()

    def _generate_batch(self, latents: list[torch.Tensor]) -> list[torch.Tensor]:
        """One generator call for the latents of many requests; each gets its own rows back."""
        with torch.inference_mode():
            images = generate(self.generator, torch.cat(latents))  # (sum N, 3, H, W) in [-1, 1]
        return list(images.split([len(z) for z in latents]))

    async def _generate(self, z: torch.Tensor) -> torch.Tensor:
        """Images for latents z (N, z_dim) through the batcher, in pieces of at most a batch."""
        pieces = await asyncio.gather(*(self.batcher.submit(part) for part in z.split(self.batcher.max_size)))
        return torch.cat(pieces)

    @unary(gan_pb2.GanSampleRequest, common_pb2.ImagesResponse)
    async def Sample(self, request: gan_pb2.GanSampleRequest) -> common_pb2.ImagesResponse:
        req = parse(SampleIn, request)
        seed = resolve_seed(req.seed)
        images = await self._generate(sample_latents(req.num_images, seed, req.truncation, self.z_dim))
        self.metrics.images("Sample", images.shape[0])
        return images_response(images, seed)

    @unary(gan_pb2.GanInterpolateRequest, common_pb2.ImagesResponse)
    async def Interpolate(self, request: gan_pb2.GanInterpolateRequest) -> common_pb2.ImagesResponse:
        req = parse(InterpolateIn, request)
        z0 = sample_latents(1, req.seed_start, req.truncation, self.z_dim)
        z1 = sample_latents(1, req.seed_end, req.truncation, self.z_dim)
        z = slerp(z0, z1, torch.linspace(0, 1, req.steps).unsqueeze(-1))  # (steps, z_dim)
        images = await self._generate(z)
        self.metrics.images("Interpolate", images.shape[0])
        return images_response(images, req.seed_start)

    @unary(health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse)
    async def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        return health.check(request, SERVICE, serving=True)


def build(args: dict[str, Any] | None = None) -> Application:
    return build_app("gan", ImageGan, args, BatchArgs)
