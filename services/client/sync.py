"""The blocking client: one channel (plaintext or TLS, services/client/tls.py) to the Serve gRPC proxy, the
`application` metadata (and the API key's `authorization: Bearer <key>`) set per call; idempotent unary calls are
retried (services/client/retries.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genserve.v1 import (
    common_pb2,
    common_pb2_grpc,
    diffusion_pb2,
    diffusion_pb2_grpc,
    gan_pb2_grpc,
    text_pb2,
    text_pb2_grpc,
    vae_pb2,
    vae_pb2_grpc,
)

from . import requests
from .errors import from_rpc_error
from .retries import DEFAULT_RETRY, RetryPolicy, remaining, seeded
from .tls import ClientTls, channel

DEFAULT_ADDRESS = os.environ.get("GENSERVE_ADDRESS", "127.0.0.1:9000")
API_KEY_ENV = "GENSERVE_API_KEY"
# Images and latents of a full batch stay well under this.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


@dataclass(frozen=True)
class Stubs:
    """One stub per service on a channel; the same for a blocking and a grpc.aio channel."""

    text: text_pb2_grpc.TextGenerationStub
    gan: gan_pb2_grpc.ImageGanStub
    vae: vae_pb2_grpc.VaeStub
    diffusion: diffusion_pb2_grpc.DiffusionStub
    health: health_pb2_grpc.HealthStub
    status: common_pb2_grpc.ServeStatusStub

    @classmethod
    def on(cls, channel: grpc.Channel | grpc.aio.Channel) -> Stubs:
        return cls(
            text_pb2_grpc.TextGenerationStub(channel), gan_pb2_grpc.ImageGanStub(channel),
            vae_pb2_grpc.VaeStub(channel), diffusion_pb2_grpc.DiffusionStub(channel),
            health_pb2_grpc.HealthStub(channel), common_pb2_grpc.ServeStatusStub(channel),
        )


def metadata(application: str, api_key: str | None = None, model: str = "") -> tuple[tuple[str, str], ...]:
    """The routing metadata, and the key as gRPC's conventional bearer token (docs/security.md). `model`: a LoRA
    adapter's name as Ray Serve's multiplexed model id, so the proxy prefers a replica that holds it."""
    key = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    multiplexed = (("multiplexed_model_id", model),) if model else ()
    return (("application", application), *key, *multiplexed)


def api_key_or_env(api_key: str | None) -> str | None:
    """The key given, else $GENSERVE_API_KEY, else None (a server without keys serves this host without one)."""
    return api_key or os.environ.get(API_KEY_ENV) or None


class Client:
    """genserve over gRPC. Every method raises a genserve.services.client.errors.GenserveError subclass on failure.
    `api_key` (default $GENSERVE_API_KEY) goes with every call."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float | None = None, api_key: str | None = None,
                 retry: RetryPolicy | None = DEFAULT_RETRY, tls: ClientTls | None = None):
        """`tls`: connect over TLS (genserve.services.client.tls); None: plaintext."""
        self.address = address
        self.timeout = timeout  # the whole call's, retries included
        self.retry = retry
        self._api_key = api_key_or_env(api_key)
        self._channel = channel(address, tls, CHANNEL_OPTIONS)
        self._stubs = Stubs.on(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, method: Any, application: str, request: Any, *, idempotent: bool = False, model: str = "") -> Any:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        attempt = 0
        while True:
            try:
                return method(request, metadata=metadata(application, self._api_key, model),
                              timeout=remaining(deadline))
            except grpc.RpcError as error:
                wait = self.retry.delay(error, attempt, deadline) if idempotent and self.retry else None
                if wait is None:
                    raise from_rpc_error(error) from None
            time.sleep(wait)
            attempt += 1

    def _stream(self, method: Any, application: str, request: Any, model: str = "") -> Iterator[Any]:
        call = method(request, metadata=metadata(application, self._api_key, model), timeout=self.timeout)
        try:
            yield from call
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        finally:
            call.cancel()  # a consumer that stops early frees the server's work (no-op after the end)

    # text
    def generate(self, prompt: str = "", **options: Any) -> text_pb2.TextResponse:
        request = requests.text_request(prompt, **options)
        return self._unary(self._stubs.text.Generate, "text", request, model=request.adapter)

    def generate_stream(self, prompt: str = "", **options: Any) -> Iterator[text_pb2.TextChunk]:
        request = requests.text_request(prompt, **options)
        return self._stream(self._stubs.text.GenerateStream, "text", request, model=request.adapter)

    def tokenize(self, text: str = "", *, messages: Sequence[dict[str, str]] = (),
                 model: str | None = None) -> text_pb2.TokenizeResponse:
        request = requests.tokenize_request(text, messages=messages, model=model)
        return self._unary(self._stubs.text.Tokenize, "text", request, idempotent=True)

    def model_info(self, model: str | None = None) -> text_pb2.ModelInfo:
        """The text app's first model, or its further base model `model` (ModelInfo.models lists them)."""
        request = requests.model_info_request(model)
        return self._unary(self._stubs.text.GetModelInfo, "text", request, idempotent=True)

    def load_adapter(self, name: str, path: str) -> list[str]:
        """Load the LoRA adapter folder `path` (under the server's lora.root) as `name`; the adapters loaded after.
        Needs an admin key when the server has keys."""
        request = text_pb2.LoadAdapterRequest(name=name, path=path)
        return list(self._unary(self._stubs.text.LoadAdapter, "text", request).adapters)

    def unload_adapter(self, name: str) -> list[str]:
        request = text_pb2.UnloadAdapterRequest(name=name)
        return list(self._unary(self._stubs.text.UnloadAdapter, "text", request).adapters)

    # gan
    def gan_sample(self, num_images: int | None = None, **options: Any) -> common_pb2.ImagesResponse:
        request = requests.gan_sample_request(num_images, **options)
        return self._unary(self._stubs.gan.Sample, "gan", request, idempotent=seeded(request))

    def gan_interpolate(self, seed_start: int, seed_end: int, **options: Any) -> common_pb2.ImagesResponse:
        request = requests.gan_interpolate_request(seed_start, seed_end, **options)
        return self._unary(self._stubs.gan.Interpolate, "gan", request, idempotent=True)

    # vae
    def vae_encode(self, pngs: Iterable[bytes], **options: Any) -> vae_pb2.EncodeResponse:
        request = requests.encode_request(pngs, **options)
        return self._unary(self._stubs.vae.Encode, "vae", request, idempotent=seeded(request))

    def vae_decode(self, shape: Sequence[int], values: Iterable[float]) -> common_pb2.ImagesResponse:
        return self._unary(self._stubs.vae.Decode, "vae", requests.decode_request(shape, values), idempotent=True)

    def vae_reconstruct(self, pngs: Iterable[bytes]) -> common_pb2.ImagesResponse:
        return self._unary(self._stubs.vae.Reconstruct, "vae", requests.reconstruct_request(pngs), idempotent=True)

    # diffusion
    def diffuse(self, prompt: str, **options: Any) -> common_pb2.ImagesResponse:
        return self._unary(self._stubs.diffusion.Generate, "diffusion", requests.diffusion_request(prompt, **options))

    def diffuse_stream(self, prompt: str, **options: Any) -> Iterator[diffusion_pb2.DiffusionEvent]:
        request = requests.diffusion_request(prompt, **options)
        return self._stream(self._stubs.diffusion.GenerateStream, "diffusion", request)

    # operations
    def health(self, service: str = "", *, application: str = "health") -> int:
        """grpc.health.v1 status (SERVING = 1, NOT_SERVING = 2) of `service` as `application` answers it."""
        request = health_pb2.HealthCheckRequest(service=service)
        return self._unary(self._stubs.health.Check, application, request, idempotent=True).status

    def status(self) -> common_pb2.StatusResponse:
        return self._unary(self._stubs.status.GetStatus, "health", common_pb2.StatusRequest(), idempotent=True)
