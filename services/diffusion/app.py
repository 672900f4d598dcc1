"""The `diffusion` application: genserve.v1.Diffusion (Generate, GenerateStream) on Ray Serve.

A replica runs ONE denoising loop for all its requests (services/diffusion/step_batcher.py): a request's text is
encoded and its noise drawn in a worker thread, then it joins the loop at the next step boundary, every request's
passes share one U-Net call per step, and each reports its own steps through a queue, so the stream sends progress
(and optional previews) while the loop runs. The loop's row budget and first wait are serve-config args
(`max_step_rows`, `batch_wait_s`, docs/deploy.md). The final latents go to the `vae` application's
`Decode` through a deployment handle as raw bytes with dtype and shape, the same Tensor message a gRPC client
sends. The model is the committed demo or a Stable-Diffusion-, SD3- or Flux-format diffusers folder
(GENSERVE_DIFFUSION_MODEL). An edit (init_image, optionally a mask) is encoded by the `vae` application's `Encode`
first; its posterior starts the loop (services/diffusion/edits.py). A Stable-Diffusion-format model serves LoRAs
(serve-config `loras`, services/diffusion/loras.py), which a request names in `lora`; `load_lora`, `unload_lora` and
`loras` are the replica's in-process API for them (deployment-handle methods, not RPCs).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

import torch
from grpc_health.v1 import health_pb2
from PIL import Image as PILImage
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve
from ray.serve.deployment import Application
from ray.util import metrics

from genserve.services.common import health
from genserve.services.common.builder import AppArgs, build_app, handle_to
from genserve.services.common.device import serving_device, use_torch_threads
from genserve.services.common.errors import InvalidArgument
from genserve.services.common.gate import Gate
from genserve.services.common.gc_freeze import freeze_loaded_objects
from genserve.services.common.images import image_messages, tensor_from_message, tensor_message
from genserve.services.common.metrics import ServiceMetrics
from genserve.services.common.rpc import streaming, unary, unknown_rpcs
from genserve.services.common.validation import parse
from genserve.services.diffusion.edit_inputs import edit_inputs, masked_image, png_bytes
from genserve.services.diffusion.edits import Posterior
from genserve.services.diffusion.loras import LoraConfig, LoraRegistry
from genserve.services.diffusion.params import LORA_NAME, InvalidLora
from genserve.services.diffusion.pipeline import DiffusionPipeline
from genserve.services.diffusion.schema import KNOWN_ERRORS, MAX_REQUEST_ROWS, DiffusionIn
from genserve.services.diffusion.step_batcher import StepBatcher
from genserve.shared.seeds import resolve_seed
from genserve.v1 import common_pb2, diffusion_pb2, vae_pb2

SERVICE = "genserve.v1.Diffusion"
_DONE = object()


class LoraArgs(BaseModel):
    """The diffusion app's `loras` arg (docs/deploy.md, "LoRAs"): services/diffusion/loras.py's LoraConfig."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str = Field(min_length=1)  # LoRAs load only from under this folder (on the replica's machine)
    max_loras: int = Field(16, ge=1, le=1024)
    max_rank: int = Field(128, ge=1, le=1024)
    load: dict[str, str] = {}  # name -> file or folder under root, loaded at start

    @field_validator("load")
    @classmethod
    def _names(cls, load: dict[str, str]) -> dict[str, str]:
        for name in load:
            if not re.fullmatch(LORA_NAME, name):
                raise ValueError(f"LoRA name {name!r} must match {LORA_NAME}")
        return load

    def config(self) -> LoraConfig:
        return LoraConfig(self.root, self.max_loras, self.max_rank, tuple(self.load.items()))


class StepBatchArgs(AppArgs):
    """The serve-config `args` of the diffusion app: docs/deploy.md."""

    # U-Net rows per step (images × passes, all requests in the loop); a waiting request joins when its rows fit.
    max_step_rows: int = Field(48, ge=MAX_REQUEST_ROWS, le=4096)
    batch_wait_s: float = Field(0.005, ge=0, le=1, allow_inf_nan=False)  # how long an idle loop waits for others
    loras: LoraArgs | None = None  # None: no LoRAs


@functools.cache
def cached_steps() -> metrics.Counter:
    """Denoising steps whose later transformer blocks FirstBlockCache skipped (created in the replica, once)."""
    return metrics.Counter("genserve_diffusion_cached_steps",
                           description="Denoising steps whose later blocks the step cache skipped.")


def _progress(step: int, total: int, elapsed: float) -> diffusion_pb2.DiffusionEvent:
    return diffusion_pb2.DiffusionEvent(
        progress=diffusion_pb2.DiffusionProgress(step=step, total_steps=total, elapsed_s=elapsed)
    )


@serve.deployment(name="Diffusion")
class Diffusion:
    __getattr__ = unknown_rpcs
    known_errors = KNOWN_ERRORS

    def __init__(self, model_dir: str | None, settings: StepBatchArgs | None = None):
        settings = settings or StepBatchArgs()
        use_torch_threads(settings.torch_threads)
        self.metrics = ServiceMetrics("diffusion")
        self.gate = Gate.from_env(settings.rate_limits)
        self.pipe = DiffusionPipeline.from_dir(model_dir, device=serving_device(),
                                               loras=settings.loras.config() if settings.loras else None)
        self.batcher = StepBatcher(self.pipe.model.unet, settings.max_step_rows, settings.batch_wait_s,
                                   on_batch=lambda images, waits: self.metrics.batch("Generate", images, waits),
                                   unet_rows=self.pipe.unet_rows)
        self._vae = None
        self._status = health.ServeStatusCache()
        freeze_loaded_objects()

    def _decoder(self) -> Any:
        if self._vae is None:
            self._vae = handle_to("vae")
        return self._vae

    async def _events(self, request: diffusion_pb2.DiffusionRequest) -> AsyncIterator[diffusion_pb2.DiffusionEvent]:
        """Progress and preview events while the loop runs in a thread, then the decoded images (last event)."""
        req = parse(DiffusionIn, request)
        image = mask = None
        if req.init_image:  # an edit: the output size defaults to the image's
            image, mask, (height, width) = edit_inputs(req.init_image, req.mask, req.height, req.width)
        else:
            height, width = req.height or self.pipe.model.native_size[0], req.width or self.pipe.model.native_size[1]
        problem = self.pipe.size_error(height, width) or self.pipe.option_error(req.scheduler)
        if problem is not None:
            raise InvalidArgument(*problem)
        if req.cache_threshold is not None and not self.pipe.caches_steps:
            raise InvalidArgument("cache_threshold", "step caching runs on diffusion transformers (SD3, Flux) only")
        if req.preview_every and self.pipe.model.preview is None:
            raise InvalidArgument("preview_every", "this model has no preview; use 0")
        seed = resolve_seed(req.seed)
        init = None if image is None else await self._encode(image)
        masked = None
        if self.pipe.model.inpainting_unet and image is not None and mask is not None:
            masked = await self._encode(masked_image(image, mask))  # what a 9-channel inpainting U-Net reads
        loop, queue, cancel = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
        start = time.perf_counter()

        def on_step(step: int, total: int, latents: torch.Tensor) -> None:
            events = [_progress(step, total, time.perf_counter() - start)]
            if req.preview_every and step and step % req.preview_every == 0:
                preview = diffusion_pb2.DiffusionPreview(step=step, images=image_messages(self.pipe.preview(latents)))
                events.append(diffusion_pb2.DiffusionEvent(preview=preview))
            for event in events:
                loop.call_soon_threadsafe(queue.put_nowait, event)

        def prepare() -> Future:
            state = self.pipe.prepare(
                [req.prompt] * req.num_images, [req.negative_prompt] * req.num_images, steps=req.steps,
                guidance_scale=req.guidance_scale, seed=seed, scheduler=req.scheduler or None, eta=req.eta,
                height=height, width=width, guidance=req.guidance or None, negative_weight=req.negative_weight,
                init=init, strength=req.edit_strength, mask=mask, cache_threshold=req.cache_threshold, masked=masked,
                lora=req.lora, lora_scale=1.0 if req.lora_scale is None else req.lora_scale,
            )
            cache = getattr(state.context, "step_cache", None)
            if cache is not None:  # count the steps it skipped once the request is done
                future = self.batcher.submit(state, on_step, cancel.is_set)
                future.add_done_callback(lambda _: cached_steps().inc(cache.skipped))
                return future
            return self.batcher.submit(state, on_step, cancel.is_set)

        try:
            future = await asyncio.to_thread(prepare)
            future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, _DONE))
            last = 0.0
            while (event := await queue.get()) is not _DONE:
                if event.HasField("progress"):
                    if event.progress.step:  # step 0 says the denoising started; the steps count from there
                        self.metrics.denoising_step(event.progress.elapsed_s - last)
                    last = event.progress.elapsed_s
                yield event
            latents = future.result()  # (N, C, h, w), ready for the VAE's decode
        finally:
            cancel.set()  # the loop drops this request at its next step when the client went away
        message = await asyncio.to_thread(tensor_message, latents)  # a device-to-host copy: off the event loop
        images = await self._decoder().Decode.remote(vae_pb2.DecodeRequest(latents=message))
        images.seed = seed
        self.metrics.images("Generate", len(images.images))
        yield diffusion_pb2.DiffusionEvent(result=images)

    async def _encode(self, image: PILImage.Image) -> Posterior:
        """The `vae` application's posterior of an edit's init image (the diffusion loop samples it with the
        request's seed, in diffusers' order: services/diffusion/edits.py)."""
        request = vae_pb2.EncodeRequest(images=[common_pb2.Image(png=png_bytes(image), width=image.width,
                                                                 height=image.height)])
        encoded = await self._decoder().Encode.remote(request)
        device = self.pipe.device
        return Posterior(tensor_from_message(encoded.mean, "mean").to(device),
                         tensor_from_message(encoded.logvar, "logvar").to(device))

    @unary(diffusion_pb2.DiffusionRequest, common_pb2.ImagesResponse)
    async def Generate(self, request: diffusion_pb2.DiffusionRequest) -> common_pb2.ImagesResponse:
        result = common_pb2.ImagesResponse()
        async with contextlib.aclosing(self._events(request)) as events:
            async for event in events:
                if event.HasField("result"):
                    result = event.result
        return result

    @streaming(diffusion_pb2.DiffusionRequest)
    async def GenerateStream(
        self, request: diffusion_pb2.DiffusionRequest
    ) -> AsyncIterator[diffusion_pb2.DiffusionEvent]:
        async with contextlib.aclosing(self._events(request)) as events:
            async for event in events:
                yield event

    def _loras(self) -> LoraRegistry:
        if self.pipe.loras is None:
            raise InvalidLora("this replica serves no LoRAs (serve-config args: loras)")
        return self.pipe.loras

    async def load_lora(self, name: str, path: str) -> None:
        """Load the LoRA at ``path`` (under the configured root) as ``name``; InvalidLora naming the tensor or path,
        LoraCapacityExceeded past max_loras."""
        await asyncio.to_thread(self._loras().load, name, path)

    async def unload_lora(self, name: str) -> None:
        """Stop serving ``name`` (requests already running on it finish); LoraNotFound."""
        self._loras().unload(name)

    async def loras(self) -> list[str]:
        return [] if self.pipe.loras is None else self.pipe.loras.names()

    async def image_size(self) -> tuple[int, int]:
        """(width, height) of the images this pipeline makes: its latent size times the VAE's downsampling
        (a deployment-handle method for the HTTP API, not an RPC)."""
        _, height, width = self.pipe.latent_shape
        factor = await self._decoder().downsample_factor.remote()
        return width * factor, height * factor

    @unary(health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse)
    async def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        """NOT_SERVING while the `vae` application (which decodes our latents) is not RUNNING."""
        running = await asyncio.to_thread(self._status.running)
        return health.check(request, SERVICE, serving=running.get("vae", False))


def build(args: dict[str, Any] | None = None) -> Application:
    return build_app("diffusion", Diffusion, args, StepBatchArgs)
