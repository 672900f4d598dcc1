"""Mixed load on the four genserve applications over gRPC, and on the OpenAI-compatible HTTP API (locust 2.47; run
it through `make load`).

One locust User per application, weighted like a realistic mix: text (unary and streaming), GAN samples,
VAE reconstructions and a few diffusion generations over gRPC; and `OpenAIUser`, streamed chats and images over
HTTP (the API on Serve's HTTP proxy: `--host`'s port - 1000, or GENSERVE_LOAD_HTTP_URL). Every gRPC call goes
through `LocustInterceptor`, which fires
`events.request` with the RPC's latency: streaming RPCs fire once at the first message (time to first token) and
once at the end (total). RESOURCE_EXHAUSTED is the server shedding load on purpose, so it is recorded under the
RPC's name plus `SHED_SUFFIX`, apart from real failures; every failure's message is its gRPC status code name.

Knobs (environment): GENSERVE_API_KEY (sent as `authorization: Bearer <key>` when the stack has keys),
GENSERVE_LOAD_THINK_S (mean think time per user, 0 = back-to-back),
GENSERVE_LOAD_WEIGHTS (user mix, default "text=4,gan=2,vae=2,diffusion=1,http=2"), GENSERVE_LOAD_MAX_TOKENS,
GENSERVE_LOAD_DIFFUSION_STEPS, GENSERVE_LOAD_DEADLINE_S, and GENSERVE_LOAD_LOG: a file that receives one JSON line
per request event ({"t", "name", "ms", "code"}), which `python -m tests.load.run` turns into docs/load.md.
"""

from __future__ import annotations

# gRPC must cooperate with gevent before any channel exists, or locust hangs after ramp-up.
from grpc.experimental import gevent as grpc_gevent

grpc_gevent.init_gevent()

import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import requests  # noqa: E402
from locust import User, between, constant, events, task  # noqa: E402
from locust.env import Environment  # noqa: E402
from PIL import Image as PILImage  # noqa: E402

from genserve.v1 import (  # noqa: E402
    common_pb2,
    diffusion_pb2,
    diffusion_pb2_grpc,
    gan_pb2,
    gan_pb2_grpc,
    text_pb2,
    text_pb2_grpc,
    vae_pb2,
    vae_pb2_grpc,
)

SHED_SUFFIX = " [shed]"
FIRST_SUFFIX = " [first]"
DEFAULT_HOST = "127.0.0.1:9000"
API_KEY = os.environ.get("GENSERVE_API_KEY", "")
AUTHORIZATION = (("authorization", f"Bearer {API_KEY}"),) if API_KEY else ()

THINK_S = float(os.environ.get("GENSERVE_LOAD_THINK_S", "1.0"))
MAX_TOKENS = int(os.environ.get("GENSERVE_LOAD_MAX_TOKENS", "16"))
DIFFUSION_STEPS = int(os.environ.get("GENSERVE_LOAD_DIFFUSION_STEPS", "4"))
DEADLINE_S = float(os.environ.get("GENSERVE_LOAD_DEADLINE_S", "60"))
WEIGHTS = {"text": 4, "gan": 2, "vae": 2, "diffusion": 1, "http": 2} | {
    app: int(weight)
    for app, weight in (
        item.split("=") for item in os.environ.get("GENSERVE_LOAD_WEIGHTS", "").split(",") if item.strip()
    )
}

PROMPTS = (
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "A short poem about the sea:",
    "In machine learning, attention is",
)
CAPTIONS = ("a red circle", "a small blue square", "a large green triangle", "two yellow circles")


class GrpcStatusError(Exception):
    """A failed RPC; its message is only the status code name, so locust groups failures by code."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code.name)
        self.code = code


def rpc_name(method: str) -> str:
    """'/genserve.v1.TextGeneration/Generate' -> 'TextGeneration/Generate'."""
    service, rpc = method.strip("/").split("/")
    return f"{service.rsplit('.', 1)[-1]}/{rpc}"


class LocustInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Reports every unary and server-streaming call to locust's `events.request`."""

    def __init__(self, environment: Environment) -> None:
        self._environment = environment

    def _fire(self, name: str, start: float, length: int, error: grpc.RpcError | None) -> None:
        exception = None
        if error is not None:
            code = error.code()
            exception = GrpcStatusError(code)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                name += SHED_SUFFIX
        self._environment.events.request.fire(
            request_type="grpc",
            name=name,
            response_time=(time.perf_counter() - start) * 1000.0,
            response_length=length,
            exception=exception,
            context={},
        )

    def intercept_unary_unary(self, continuation: Callable, client_call_details, request):
        start = time.perf_counter()
        call = continuation(client_call_details, request)
        name = rpc_name(client_call_details.method)
        try:
            response = call.result()
        except grpc.RpcError as error:
            self._fire(name, start, 0, error)
        else:
            self._fire(name, start, response.ByteSize(), None)
        return call

    def intercept_unary_stream(self, continuation: Callable, client_call_details, request):
        start = time.perf_counter()
        call = continuation(client_call_details, request)
        return self._timed_stream(rpc_name(client_call_details.method), start, call)

    def _timed_stream(self, name: str, start: float, call: Iterator) -> Iterator:
        """Yields the stream's messages; fires `name [first]` at the first one and `name` at the end."""
        length = 0
        try:
            for message in call:
                if length == 0:
                    self._fire(name + FIRST_SUFFIX, start, message.ByteSize(), None)
                length += message.ByteSize()
                yield message
        except grpc.RpcError as error:
            self._fire(name, start, length, error)
        else:
            self._fire(name, start, length, None)


class HttpStatusError(Exception):
    """A failed HTTP call; 429 is the server shedding load, recorded like gRPC's RESOURCE_EXHAUSTED."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.code = "RESOURCE_EXHAUSTED" if status == 429 else f"HTTP_{status}"


def status_code(exception: BaseException | None) -> str:
    """'OK', a gRPC status code name (HTTP: 429 as RESOURCE_EXHAUSTED, else HTTP_<status>), or the exception's
    type for anything else."""
    if exception is None:
        return "OK"
    if isinstance(exception, GrpcStatusError):
        return exception.code.name
    return exception.code if isinstance(exception, HttpStatusError) else type(exception).__name__


@events.init.add_listener
def _log_requests(environment: Environment, **_kwargs) -> None:
    """Appends every request event to GENSERVE_LOAD_LOG, line-buffered so a killed run keeps what it measured."""
    path = os.environ.get("GENSERVE_LOAD_LOG")
    if not path:
        return
    log = open(path, "a", buffering=1)  # closed by the quitting listener

    def on_request(name: str, response_time: float, exception: BaseException | None, **_kwargs) -> None:
        record = {"t": round(time.time(), 3), "name": name, "ms": round(response_time, 2)}
        log.write(json.dumps(record | {"code": status_code(exception)}) + "\n")

    environment.events.request.add_listener(on_request)
    environment.events.quitting.add_listener(lambda **_kwargs: log.close())


def _png(rng: np.random.Generator, size: int = 32) -> bytes:
    """A small RGB PNG of random blocks, the kind of image the VAE was trained on."""
    blocks = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    pixels = np.kron(blocks, np.ones((size // 4, size // 4, 1), dtype=np.uint8))
    buffer = io.BytesIO()
    PILImage.fromarray(pixels, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


_IMAGES = [common_pb2.Image(png=_png(np.random.default_rng(i)), width=32, height=32) for i in range(8)]


class GenserveUser(User):
    """A user of one application: owns a channel with the locust interceptor and the `application` metadata."""

    abstract = True
    host = DEFAULT_HOST
    application = ""
    wait_time = between(0.5 * THINK_S, 1.5 * THINK_S) if THINK_S > 0 else constant(0)

    def on_start(self) -> None:
        self._raw_channel = grpc.insecure_channel(self.host)
        self.channel = grpc.intercept_channel(self._raw_channel, LocustInterceptor(self.environment))
        self.metadata = (("application", self.application), *AUTHORIZATION)

    def on_stop(self) -> None:
        self._raw_channel.close()

    def call(self, method: Callable, request) -> None:
        """A unary call; its outcome is already recorded by the interceptor."""
        try:
            method(request, metadata=self.metadata, timeout=DEADLINE_S)
        except grpc.RpcError:
            pass

    def stream(self, method: Callable, request) -> None:
        """Drains a server stream; the interceptor records first message, total and errors."""
        for _ in method(request, metadata=self.metadata, timeout=DEADLINE_S):
            pass


class TextUser(GenserveUser):
    weight = WEIGHTS["text"]
    application = "text"

    def on_start(self) -> None:
        super().on_start()
        self.stub = text_pb2_grpc.TextGenerationStub(self.channel)

    def _request(self) -> text_pb2.TextRequest:
        return text_pb2.TextRequest(
            prompt=random.choice(PROMPTS),
            max_tokens=MAX_TOKENS,
            temperature=0.8,
            top_p=0.95,
            seed=random.randrange(2**31),
        )

    @task(3)
    def generate(self) -> None:
        self.call(self.stub.Generate, self._request())

    @task(2)
    def generate_stream(self) -> None:
        self.stream(self.stub.GenerateStream, self._request())


class GanUser(GenserveUser):
    weight = WEIGHTS["gan"]
    application = "gan"

    def on_start(self) -> None:
        super().on_start()
        self.stub = gan_pb2_grpc.ImageGanStub(self.channel)

    @task
    def sample(self) -> None:
        request = gan_pb2.GanSampleRequest(num_images=4, seed=random.randrange(2**31), truncation=0.8)
        self.call(self.stub.Sample, request)


class VaeUser(GenserveUser):
    weight = WEIGHTS["vae"]
    application = "vae"

    def on_start(self) -> None:
        super().on_start()
        self.stub = vae_pb2_grpc.VaeStub(self.channel)

    @task
    def reconstruct(self) -> None:
        self.call(self.stub.Reconstruct, vae_pb2.ReconstructRequest(images=random.sample(_IMAGES, 2)))


class DiffusionUser(GenserveUser):
    weight = WEIGHTS["diffusion"]
    application = "diffusion"

    def on_start(self) -> None:
        super().on_start()
        self.stub = diffusion_pb2_grpc.DiffusionStub(self.channel)

    @task
    def generate(self) -> None:
        request = diffusion_pb2.DiffusionRequest(
            prompt=random.choice(CAPTIONS),
            num_images=1,
            steps=DIFFUSION_STEPS,
            guidance_scale=3.0,
            seed=random.randrange(2**31),
            scheduler="ddim",
        )
        self.call(self.stub.Generate, request)


def http_url(host: str) -> str:
    """The OpenAI-compatible API next to the gRPC proxy at `host` (its HTTP port is the gRPC port - 1000)."""
    if os.environ.get("GENSERVE_LOAD_HTTP_URL"):
        return os.environ["GENSERVE_LOAD_HTTP_URL"]
    name, port = host.rsplit(":", 1)
    return f"http://{name}:{int(port) - 1000}/v1"


class OpenAIUser(User):
    """The HTTP API: streamed chats (first token and whole answer, like GenerateStream) and image generations."""

    weight = WEIGHTS["http"]
    host = DEFAULT_HOST
    wait_time = between(0.5 * THINK_S, 1.5 * THINK_S) if THINK_S > 0 else constant(0)

    def on_start(self) -> None:
        self.url = http_url(self.host)
        self.session = requests.Session()
        self.session.headers.update(dict(AUTHORIZATION))

    def on_stop(self) -> None:
        self.session.close()

    def _fire(self, name: str, start: float, length: int, status: int) -> None:
        exception = None if status == 200 else HttpStatusError(status)
        if status == 429:
            name += SHED_SUFFIX
        self.environment.events.request.fire(
            request_type="http", name=name, response_time=(time.perf_counter() - start) * 1000.0,
            response_length=length, exception=exception, context={},
        )

    @task(3)
    def chat_stream(self) -> None:
        name, start, length, first = "HTTP chat.completions (stream)", time.perf_counter(), 0, True
        body = {"model": "text", "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
                "max_tokens": MAX_TOKENS, "temperature": 0.8, "top_p": 0.95, "seed": random.randrange(2**31),
                "stream": True}
        try:
            with self.session.post(f"{self.url}/chat/completions", json=body, stream=True,
                                   timeout=DEADLINE_S) as response:
                if response.status_code != 200:
                    return self._fire(name, start, 0, response.status_code)
                for line in response.iter_lines():
                    if first and b'"content":"' in line and b'"content":""' not in line:  # past the role chunk
                        self._fire(name + FIRST_SUFFIX, start, len(line), 200)
                        first = False
                    length += len(line)
        except requests.RequestException:
            return self._fire(name, start, length, 599)
        self._fire(name, start, length, 200)

    @task(1)
    def images(self) -> None:
        name, start = "HTTP images.generations", time.perf_counter()
        body = {"model": "diffusion", "prompt": random.choice(CAPTIONS), "n": 1, "steps": DIFFUSION_STEPS,
                "seed": random.randrange(2**31)}
        try:
            response = self.session.post(f"{self.url}/images/generations", json=body, timeout=DEADLINE_S)
        except requests.RequestException:
            return self._fire(name, start, 0, 599)
        self._fire(name, start, len(response.content), response.status_code)
