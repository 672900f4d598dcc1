"""The `vae` application: genserve.v1.Vae (Encode, Decode, Reconstruct) on Ray Serve.

The diffusion app calls `Decode` on this application through a deployment handle, so the two scale apart. It
serves the demo VAE (32x32 images, 4x8x8 latents) or a diffusers AutoencoderKL folder (a Stable Diffusion
pipeline's ``vae/``: any size whose sides are multiples of 8, up to MAX_PIXELS).

Encode, Decode and Reconstruct each have a batcher (services/common/batcher.py): concurrent requests become one
model call of up to `max_batch_images` images (serve config args), one call per image size, and each gets back
exactly what it would have got alone (the VAE is batch-invariant, tests/services/vae). Encode's posterior sample is
drawn from the request's own seed after its batch returns.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import torch
from grpc_health.v1 import health_pb2
from pydantic import Field
from ray import serve
from ray.serve.deployment import Application

from genserve.services.common import health
from genserve.services.common.batcher import BatchArgs, Batcher, rows_by_shape
from genserve.services.common.builder import build_app
from genserve.services.common.device import serving_device, use_torch_threads
from genserve.services.common.errors import InvalidArgument
from genserve.services.common.gate import Gate
from genserve.services.common.gc_freeze import freeze_loaded_objects
from genserve.services.common.images import MAX_PIXELS, from_png, images_response, tensor_from_message, tensor_message
from genserve.services.common.metrics import ServiceMetrics
from genserve.services.common.rpc import unary, unknown_rpcs
from genserve.services.common.validation import Request, parse
from genserve.services.vae.model import load_vae
from genserve.shared.blocks.autoencoder import VAE
from genserve.shared.blocks.autoencoder_kl import is_autoencoder_kl, load_autoencoder_kl
from genserve.shared.blocks.autoencoder_kl_flow import load_flow_autoencoder_kl
from genserve.shared.seeds import resolve_seed
from genserve.v1 import common_pb2, vae_pb2

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


def _kl_folder(directory: Path, device: torch.device) -> VAE:
    """An AutoencoderKL folder: SD's, or SD3's and Flux's 16-channel one without quant convs (whose shift_factor the
    diffusion pipeline applies to its latents, not this app)."""
    raw = json.loads((directory / "config.json").read_text())
    if raw.get("use_quant_conv", True) and raw.get("use_post_quant_conv", True):
        return load_autoencoder_kl(directory, device=device)
    return load_flow_autoencoder_kl(directory, device=device)[0]


def load_any_vae(model_dir: str | None, device: torch.device) -> tuple[VAE, bool]:
    """(the VAE, whether it takes any multiple-of-its-factor size): an AutoencoderKL folder, a pipeline folder's
    `vae/`, or our own format."""
    if model_dir is not None and is_autoencoder_kl(model_dir):
        return _kl_folder(Path(model_dir), device), True
    if model_dir is not None and (Path(model_dir) / "model_index.json").is_file():
        return _kl_folder(Path(model_dir) / "vae", device), True
    return load_vae(model_dir, device=device), False


@serve.deployment(name="Vae")
class Vae:
    __getattr__ = unknown_rpcs

    def __init__(self, model_dir: str | None, args: BatchArgs):
        use_torch_threads(args.torch_threads)
        self.metrics = ServiceMetrics("vae")
        self.gate = Gate.from_env(args.rate_limits)
        self.device = serving_device()
        self.vae, self.any_size = load_any_vae(model_dir, self.device)
        self.latent_shape = tuple(self.vae.config.latent_shape)
        self.image_size = self.vae.config.image_size
        self.factor = self.vae.config.downsample_factor
        self.batchers = {name: self._batcher(name, args) for name in ("encode", "decode", "reconstruct")}
        freeze_loaded_objects()

    def _batcher(self, name: str, args: BatchArgs) -> Batcher:
        """A batcher for one of the VAE's methods: its inputs' rows concatenated, one call per image size."""
        method = getattr(self.vae, name)

        def run(inputs: list[torch.Tensor]) -> list:
            def call(x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
                out = method(x.to(self.device))
                return tuple(t.cpu() for t in out) if isinstance(out, tuple) else out.cpu()

            with torch.inference_mode():
                return rows_by_shape(call, inputs)

        return Batcher(run, len, args.max_batch_images, args.batch_wait_s,
                       lambda images, waits: self.metrics.batch(name, images, waits))

    async def _batched(self, name: str, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """`self.vae.<name>(x)` through its batcher, in pieces of at most a batch."""
        batcher = self.batchers[name]
        pieces = await asyncio.gather(*(batcher.submit(part) for part in x.split(batcher.max_size)))
        if isinstance(pieces[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*pieces, strict=True))
        return torch.cat(pieces)

    def _images(self, images: list[ImageIn]) -> torch.Tensor:
        size = None if self.any_size else self.image_size
        decoded = [from_png(img.png, size, f"images[{i}].png", self.factor) for i, img in enumerate(images)]
        if len({tuple(x.shape) for x in decoded}) > 1:
            raise InvalidArgument("images", "must all have one size")
        return torch.stack(decoded)

    def _latents(self, request: vae_pb2.DecodeRequest) -> torch.Tensor:
        if not request.HasField("latents"):
            raise InvalidArgument("latents", "is required")
        shape = tuple(request.latents.shape)
        channels = self.latent_shape[0]
        if self.any_size:
            fits = len(shape) == 4 and shape[1] == channels and shape[2] * shape[3] * self.factor**2 <= MAX_PIXELS
            expected = f"(N, {channels}, h, w) with h*w*{self.factor ** 2} <= {MAX_PIXELS} pixels"
        else:
            fits = len(shape) == 4 and shape[1:] == self.latent_shape
            expected = f"(N, {', '.join(map(str, self.latent_shape))})"
        if not fits or not 1 <= shape[0] <= MAX_IMAGES:
            raise InvalidArgument("latents.shape", f"got {list(shape)}, expected {expected} with N in 1..{MAX_IMAGES}")
        return tensor_from_message(request.latents, "latents")

    @unary(vae_pb2.EncodeRequest, vae_pb2.EncodeResponse)
    async def Encode(self, request: vae_pb2.EncodeRequest) -> vae_pb2.EncodeResponse:
        req = parse(ImagesIn, request)
        x = self._images(req.images)  # (N, 3, H, W)
        generator = torch.Generator().manual_seed(resolve_seed(req.seed))
        mean, logvar = await self._batched("encode", x)  # (N, C, h, w) each
        latents = mean
        if req.sample:
            latents = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=generator)
        return vae_pb2.EncodeResponse(
            latents=tensor_message(latents),
            mean=tensor_message(mean),
            logvar=tensor_message(logvar),
            scaling_factor=self.vae.scaling_factor,
        )

    @unary(vae_pb2.DecodeRequest, common_pb2.ImagesResponse)
    async def Decode(self, request: vae_pb2.DecodeRequest) -> common_pb2.ImagesResponse:
        images = await self._batched("decode", self._latents(request))
        self.metrics.images("Decode", images.shape[0])
        return images_response(images, seed=0)

    @unary(vae_pb2.ReconstructRequest, common_pb2.ImagesResponse)
    async def Reconstruct(self, request: vae_pb2.ReconstructRequest) -> common_pb2.ImagesResponse:
        images = await self._batched("reconstruct", self._images(parse(ImagesIn, request).images))
        self.metrics.images("Reconstruct", images.shape[0])
        return images_response(images, seed=0)

    def downsample_factor(self) -> int:
        """Image pixels per latent cell along each side (a deployment-handle method, not an RPC)."""
        return self.vae.config.downsample_factor

    @unary(health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse)
    async def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        return health.check(request, SERVICE, serving=True)


def build(args: dict[str, Any] | None = None) -> Application:
    return build_app("vae", Vae, args, BatchArgs)
