"""The blocking client: two channels (plaintext or TLS, services/client/tls.py) to the Serve gRPC proxy (idempotent
unary calls on one that retries UNAVAILABLE, services/client/retries.py; the rest on one that never retries), the
`application` metadata (and the API key's `authorization: Bearer <key>`) set per call."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
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
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import requests, retries
from .errors import from_rpc_error
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


def metadata(application: str, api_key: str | None = None) -> tuple[tuple[str, str], ...]:
    """The routing metadata, and the key as gRPC's conventional bearer token (docs/security.md)."""
    key = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    return (("application", application), *key)


def api_key_or_env(api_key: str | None) -> str | None:
    """The key given, else $GENSERVE_API_KEY, else None (a server without keys serves this host without one)."""
    return api_key or os.environ.get(API_KEY_ENV) or None


class Client:
    """genserve over gRPC. Every method raises a services.client.errors.GenserveError subclass on failure.
    `api_key` (default $GENSERVE_API_KEY) goes with every call."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float | None = None, api_key: str | None = None,
                 tls: ClientTls | None = None):
        """`tls`: connect over TLS (services.client.tls); None: plaintext."""
        self.address = address
        self.timeout = timeout
        self._api_key = api_key_or_env(api_key)
        self._channel = channel(address, tls, CHANNEL_OPTIONS + retries.channel_options(retrying=False))
        self._retrying = channel(address, tls, CHANNEL_OPTIONS + retries.channel_options(retrying=True))
        self._stubs = Stubs.on(self._channel)
        self._idempotent = Stubs.on(self._retrying)

    def close(self) -> None:
        self._channel.close()
        self._retrying.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stubs_for(self, request: Any) -> Stubs:
        return self._idempotent if retries.seeded(request) else self._stubs

    def _unary(self, method: Any, application: str, request: Any) -> Any:
        try:
            return method(request, metadata=metadata(application, self._api_key), timeout=self.timeout)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def _stream(self, method: Any, application: str, request: Any) -> Iterator[Any]:
        call = method(request, metadata=metadata(application, self._api_key), timeout=self.timeout)
        try:
            yield from call
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        finally:
            call.cancel()  # a consumer that stops early frees the server's work (no-op after the end)

    # text
    def generate(self, prompt: str = "", **options: Any) -> text_pb2.TextResponse:
        return self._unary(self._stubs.text.Generate, "text", requests.text_request(prompt, **options))

    def generate_stream(self, prompt: str = "", **options: Any) -> Iterator[text_pb2.TextChunk]:
        return self._stream(self._stubs.text.GenerateStream, "text", requests.text_request(prompt, **options))

    def tokenize(self, text: str = "", *, messages: Sequence[dict[str, str]] = ()) -> text_pb2.TokenizeResponse:
        return self._unary(self._idempotent.text.Tokenize, "text", requests.tokenize_request(text, messages=messages))

    def model_info(self) -> text_pb2.ModelInfo:
        return self._unary(self._idempotent.text.GetModelInfo, "text", text_pb2.ModelInfoRequest())

    # gan
    def gan_sample(self, num_images: int | None = None, **options: Any) -> common_pb2.ImagesResponse:
        request = requests.gan_sample_request(num_images, **options)
        return self._unary(self._stubs_for(request).gan.Sample, "gan", request)

    def gan_interpolate(self, seed_start: int, seed_end: int, **options: Any) -> common_pb2.ImagesResponse:
        request = requests.gan_interpolate_request(seed_start, seed_end, **options)
        return self._unary(self._idempotent.gan.Interpolate, "gan", request)

    # vae
    def vae_encode(self, pngs: Iterable[bytes], **options: Any) -> vae_pb2.EncodeResponse:
        request = requests.encode_request(pngs, **options)
        return self._unary(self._stubs_for(request).vae.Encode, "vae", request)

    def vae_decode(self, shape: Sequence[int], values: Iterable[float]) -> common_pb2.ImagesResponse:
        return self._unary(self._idempotent.vae.Decode, "vae", requests.decode_request(shape, values))

    def vae_reconstruct(self, pngs: Iterable[bytes]) -> common_pb2.ImagesResponse:
        return self._unary(self._idempotent.vae.Reconstruct, "vae", requests.reconstruct_request(pngs))

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
        return self._unary(self._idempotent.health.Check, application, request).status

    def status(self) -> common_pb2.StatusResponse:
        return self._unary(self._idempotent.status.GetStatus, "health", common_pb2.StatusRequest())
