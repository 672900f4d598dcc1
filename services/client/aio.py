"""The asyncio client: the same calls as genserve.services.client.sync.Client, on a grpc.aio channel."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from genserve.v1 import (
    common_pb2,
    diffusion_pb2,
    text_pb2,
    vae_pb2,
)

from . import requests
from .errors import from_rpc_error
from .retries import DEFAULT_RETRY, RetryPolicy, remaining, seeded
from .sync import CHANNEL_OPTIONS, DEFAULT_ADDRESS, Stubs, api_key_or_env, metadata
from .tls import ClientTls, aio_channel


class AsyncClient:
    """genserve over gRPC from asyncio code; use `async with AsyncClient() as client:`."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float | None = None, api_key: str | None = None,
                 retry: RetryPolicy | None = DEFAULT_RETRY, tls: ClientTls | None = None):
        self.address = address
        self.timeout = timeout  # the whole call's, retries included
        self.retry = retry
        self._api_key = api_key_or_env(api_key)
        self._channel = aio_channel(address, tls, CHANNEL_OPTIONS)
        self._stubs = Stubs.on(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _unary(self, method: Any, application: str, request: Any, *, idempotent: bool = False,
                     model: str = "") -> Any:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        attempt = 0
        while True:
            try:
                return await method(request, metadata=metadata(application, self._api_key, model),
                                    timeout=remaining(deadline))
            except grpc.RpcError as error:
                wait = self.retry.delay(error, attempt, deadline) if idempotent and self.retry else None
                if wait is None:
                    raise from_rpc_error(error) from None
            await asyncio.sleep(wait)
            attempt += 1

    async def _stream(self, method: Any, application: str, request: Any, model: str = "") -> AsyncIterator[Any]:
        call = method(request, metadata=metadata(application, self._api_key, model), timeout=self.timeout)
        try:
            async for message in call:
                yield message
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        finally:
            call.cancel()

    # text
    async def generate(self, prompt: str = "", **options: Any) -> text_pb2.TextResponse:
        request = requests.text_request(prompt, **options)
        return await self._unary(self._stubs.text.Generate, "text", request, model=request.adapter)

    def generate_stream(self, prompt: str = "", **options: Any) -> AsyncIterator[text_pb2.TextChunk]:
        request = requests.text_request(prompt, **options)
        return self._stream(self._stubs.text.GenerateStream, "text", request, model=request.adapter)

    async def tokenize(self, text: str = "", *, messages: Sequence[dict[str, str]] = (),
                       model: str | None = None) -> text_pb2.TokenizeResponse:
        request = requests.tokenize_request(text, messages=messages, model=model)
        return await self._unary(self._stubs.text.Tokenize, "text", request, idempotent=True)

    async def model_info(self, model: str | None = None) -> text_pb2.ModelInfo:
        request = requests.model_info_request(model)
        return await self._unary(self._stubs.text.GetModelInfo, "text", request, idempotent=True)

    async def load_adapter(self, name: str, path: str) -> list[str]:
        request = text_pb2.LoadAdapterRequest(name=name, path=path)
        return list((await self._unary(self._stubs.text.LoadAdapter, "text", request)).adapters)

    async def unload_adapter(self, name: str) -> list[str]:
        request = text_pb2.UnloadAdapterRequest(name=name)
        return list((await self._unary(self._stubs.text.UnloadAdapter, "text", request)).adapters)

    # gan
    async def gan_sample(self, num_images: int | None = None, **options: Any) -> common_pb2.ImagesResponse:
        request = requests.gan_sample_request(num_images, **options)
        return await self._unary(self._stubs.gan.Sample, "gan", request, idempotent=seeded(request))

    async def gan_interpolate(self, seed_start: int, seed_end: int, **options: Any) -> common_pb2.ImagesResponse:
        request = requests.gan_interpolate_request(seed_start, seed_end, **options)
        return await self._unary(self._stubs.gan.Interpolate, "gan", request, idempotent=True)

    # vae
    async def vae_encode(self, pngs: Iterable[bytes], **options: Any) -> vae_pb2.EncodeResponse:
        request = requests.encode_request(pngs, **options)
        return await self._unary(self._stubs.vae.Encode, "vae", request, idempotent=seeded(request))

    async def vae_decode(self, shape: Sequence[int], values: Iterable[float]) -> common_pb2.ImagesResponse:
        request = requests.decode_request(shape, values)
        return await self._unary(self._stubs.vae.Decode, "vae", request, idempotent=True)

    async def vae_reconstruct(self, pngs: Iterable[bytes]) -> common_pb2.ImagesResponse:
        request = requests.reconstruct_request(pngs)
        return await self._unary(self._stubs.vae.Reconstruct, "vae", request, idempotent=True)

    # diffusion
    async def diffuse(self, prompt: str, **options: Any) -> common_pb2.ImagesResponse:
        request = requests.diffusion_request(prompt, **options)
        return await self._unary(self._stubs.diffusion.Generate, "diffusion", request)

    def diffuse_stream(self, prompt: str, **options: Any) -> AsyncIterator[diffusion_pb2.DiffusionEvent]:
        request = requests.diffusion_request(prompt, **options)
        return self._stream(self._stubs.diffusion.GenerateStream, "diffusion", request)

    # operations
    async def health(self, service: str = "", *, application: str = "health") -> int:
        request = health_pb2.HealthCheckRequest(service=service)
        return (await self._unary(self._stubs.health.Check, application, request, idempotent=True)).status

    async def status(self) -> common_pb2.StatusResponse:
        return await self._unary(self._stubs.status.GetStatus, "health", common_pb2.StatusRequest(), idempotent=True)
