"""The SDK's retries: which errors, how long, and which calls (idempotent unary ones only), against a real gRPC server
that fails the first calls the way Ray Serve's proxy does (headers first, then the status)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from genserve.services.client import AsyncClient, Client
from genserve.services.client.errors import Internal, Unavailable
from genserve.services.client.retries import RetryPolicy, retryable
from genserve.v1 import common_pb2, gan_pb2_grpc, text_pb2, text_pb2_grpc

DIED = "The actor died unexpectedly before finishing this task."
# The same death when the proxy reaches replicas over gRPC (RAY_SERVE_PROXY_USE_GRPC, deploy_config.SERVE_ENV).
UNAVAILABLE_ACTOR = ("The actor 4f71dc4561f488b0fc1e2a0f01000000 is unavailable: Actor is unavailable.. The task may "
                     "or may not have been executed on the actor.")


class Failure(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "details", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, "the server is draining", True),
        (grpc.StatusCode.INTERNAL, DIED, True),
        (grpc.StatusCode.INTERNAL, UNAVAILABLE_ACTOR, True),
        (grpc.StatusCode.INTERNAL, "internal error (request id 1)", False),
        (grpc.StatusCode.INVALID_ARGUMENT, "seed: ...", False),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded", False),
    ],
)
def test_what_is_retryable(code: grpc.StatusCode, details: str, expected: bool) -> None:
    assert retryable(Failure(code, details)) is expected


def test_backoff_doubles_with_jitter_and_stops_at_attempts_and_deadline() -> None:
    policy = RetryPolicy(max_attempts=4, initial_backoff_s=0.25, max_backoff_s=1.0)
    assert [policy.backoff(n, lambda: 1.0) for n in range(4)] == [0.25, 0.5, 1.0, 1.0]
    assert [policy.backoff(n, lambda: 0.0) for n in range(3)] == [0.125, 0.25, 0.5]
    unavailable = Failure(grpc.StatusCode.UNAVAILABLE)
    assert policy.delay(unavailable, 0, None, lambda: 1.0) == 0.25
    assert policy.delay(unavailable, 3, None) is None  # the fourth attempt was the last
    assert policy.delay(unavailable, 0, time.monotonic() + 0.1, lambda: 1.0) is None  # would pass the deadline
    assert policy.delay(Failure(grpc.StatusCode.INVALID_ARGUMENT), 0, None) is None
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


class Flaky(text_pb2_grpc.TextGenerationServicer, gan_pb2_grpc.ImageGanServicer):
    """Fails the first `failures` calls of each method as Ray's proxy would: headers, an empty message, a status."""

    def __init__(self, failures: int, code: grpc.StatusCode, details: str) -> None:
        self.failures, self.code, self.details = failures, code, details
        self.calls: dict[str, int] = {}

    def _fail(self, method: str, context: grpc.ServicerContext) -> bool:
        self.calls[method] = self.calls.get(method, 0) + 1
        if self.calls[method] > self.failures:
            return False
        context.send_initial_metadata(())
        context.set_code(self.code)
        context.set_details(self.details)
        return True

    def GetModelInfo(self, request, context):
        return text_pb2.ModelInfo() if self._fail("GetModelInfo", context) else text_pb2.ModelInfo(model_name="m")

    def Generate(self, request, context):
        return text_pb2.TextResponse() if self._fail("Generate", context) else text_pb2.TextResponse(text="t")

    def Sample(self, request, context):
        return common_pb2.ImagesResponse() if self._fail("Sample", context) else common_pb2.ImagesResponse(seed=7)


@pytest.fixture
def flaky() -> Iterator[tuple[str, Flaky]]:
    servicer = Flaky(2, grpc.StatusCode.INTERNAL, DIED)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    text_pb2_grpc.add_TextGenerationServicer_to_server(servicer, server)
    gan_pb2_grpc.add_ImageGanServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


FAST = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.05)


def test_idempotent_calls_are_retried_through_a_replica_death(flaky: tuple[str, Flaky]) -> None:
    address, servicer = flaky
    with Client(address, timeout=10, retry=FAST) as client:
        assert client.model_info().model_name == "m"
        assert client.gan_sample(1, seed=3).seed == 7
    assert servicer.calls == {"GetModelInfo": 3, "Sample": 3}


def test_unseeded_samples_and_generate_are_not_retried(flaky: tuple[str, Flaky]) -> None:
    address, servicer = flaky
    with Client(address, timeout=10, retry=FAST) as client:
        with pytest.raises(Internal):
            client.gan_sample(1)
        with pytest.raises(Internal):
            client.generate("x", seed=1)
    assert servicer.calls == {"Sample": 1, "Generate": 1}


def test_the_async_client_retries_the_same_calls(flaky: tuple[str, Flaky]) -> None:
    address, servicer = flaky

    async def calls() -> tuple[str, int]:
        async with AsyncClient(address, timeout=10, retry=FAST) as client:
            info = await client.model_info()
            with pytest.raises(Internal):
                await client.gan_sample(1)
            return info.model_name, servicer.calls["Sample"]

    assert asyncio.run(calls()) == ("m", 1)
    assert servicer.calls["GetModelInfo"] == 3


def test_retries_end_within_the_call_timeout_with_the_last_error() -> None:
    start = time.monotonic()
    with Client("127.0.0.1:1", timeout=1.5) as client, pytest.raises(Unavailable, match="failed to connect"):
        client.model_info()
    assert time.monotonic() - start < 1.5
