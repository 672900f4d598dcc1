"""The handler wrapper: replies pass through, errors become a status on the context, metrics balance."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from genserve.services.common.auth import Access
from genserve.services.common.errors import InvalidArgument
from genserve.services.common.gate import Gate
from genserve.services.common.metrics import ServiceMetrics
from genserve.services.common.rpc import StatusSet, streaming, unary, unknown_rpcs
from genserve.v1 import text_pb2


class FakeContext:
    """The part of Ray Serve's RayServegRPCContext the wrapper uses."""

    def __init__(self) -> None:
        self.code, self.details = None, None

    def request_id(self) -> str:
        return "req-1"

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return [("application", "test")]

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


class Overflow(RuntimeError):
    pass


class Service:
    __getattr__ = unknown_rpcs
    known_errors = {Overflow: (grpc.StatusCode.RESOURCE_EXHAUSTED, None)}

    def __init__(self) -> None:
        self.metrics = ServiceMetrics("test")
        self.gate = Gate(Access())  # no keys: this host's calls are served

    @unary(text_pb2.TextRequest, text_pb2.TextResponse)
    async def Generate(self, request: text_pb2.TextRequest) -> text_pb2.TextResponse:
        if not request.prompt:
            raise InvalidArgument("prompt", "must not be empty")
        if request.prompt == "full":
            raise Overflow("queue full")
        if request.prompt == "bug":
            raise KeyError("/srv/secret/path.py")
        return text_pb2.TextResponse(text=request.prompt.upper())

    @streaming(text_pb2.TextRequest)
    async def GenerateStream(self, request: text_pb2.TextRequest):
        for ch in request.prompt:
            if ch == "!":
                raise InvalidArgument("prompt", "no bangs")
            yield text_pb2.TextChunk(text=ch)


def run(coro):
    return asyncio.run(coro)


def test_unary_reply_passes_through() -> None:
    service, context = Service(), FakeContext()
    reply = run(service.Generate(text_pb2.TextRequest(prompt="ab"), grpc_context=context))
    assert reply.text == "AB" and context.code is None
    assert service.metrics.ongoing == 0


@pytest.mark.parametrize(
    ("prompt", "code", "details"),
    [
        ("", grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty"),
        ("full", grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
        ("bug", grpc.StatusCode.INTERNAL, "internal error (request id req-1)"),
    ],
)
def test_unary_errors_set_the_status(prompt: str, code: grpc.StatusCode, details: str) -> None:
    service, context = Service(), FakeContext()
    reply = run(service.Generate(text_pb2.TextRequest(prompt=prompt), grpc_context=context))
    assert reply == text_pb2.TextResponse()
    assert (context.code, context.details) == (code, details)
    assert service.metrics.ongoing == 0


def test_handle_calls_reraise() -> None:
    service = Service()
    with pytest.raises(InvalidArgument):
        run(service.Generate(text_pb2.TextRequest(prompt="")))
    assert service.metrics.ongoing == 0


def test_stream_yields_then_ends_with_the_status() -> None:
    service, context, chunks = Service(), FakeContext(), []

    async def consume() -> None:
        async for chunk in service.GenerateStream(text_pb2.TextRequest(prompt="ab!c"), grpc_context=context):
            chunks.append(chunk)

    with pytest.raises(StatusSet):
        run(consume())
    assert [c.text for c in chunks] == ["a", "b"]
    assert (context.code, context.details) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt: no bangs")
    assert service.metrics.ongoing == 0


def test_wrapped_methods_keep_their_rpc_name_and_take_grpc_context() -> None:
    import inspect

    assert Service.Generate.__name__ == "Generate" and Service.GenerateStream.__name__ == "GenerateStream"
    assert "grpc_context" in inspect.signature(Service.Generate).parameters
    assert inspect.isasyncgenfunction(Service.GenerateStream)


def test_a_request_of_another_service_is_unimplemented() -> None:
    service, context = Service(), FakeContext()
    run(service.Generate(text_pb2.TokenizeRequest(text="x"), grpc_context=context))
    assert context.code == grpc.StatusCode.UNIMPLEMENTED
    assert context.details.startswith("Generate: application 'test' takes genserve.v1.TextRequest")


def test_an_unknown_rpc_is_unimplemented_and_hooks_stay_absent() -> None:
    service, context = Service(), FakeContext()
    with pytest.raises(StatusSet):
        run(service.Reconstruct(text_pb2.TextRequest(), grpc_context=context))
    assert context.code == grpc.StatusCode.UNIMPLEMENTED
    assert context.details.startswith("Reconstruct: application 'test' has no such method")
    assert not hasattr(service, "check_health") and not hasattr(service, "reconfigure")
