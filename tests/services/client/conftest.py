"""An in-process gRPC server with fake TextGeneration and ImageGan servicers, recording the metadata it gets
(GetModelInfo answers with the `authorization` metadata as its model name)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from PIL import Image

from genserve.v1 import common_pb2, gan_pb2_grpc, text_pb2, text_pb2_grpc


def png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (0, 0, 255)).save(buffer, format="PNG")
    return buffer.getvalue()


class FakeText(text_pb2_grpc.TextGenerationServicer):
    def __init__(self, seen: list) -> None:
        self.seen = seen
        self.adapters: set[str] = set()

    def Generate(self, request, context):
        self.seen.append((dict(context.invocation_metadata()).get("application"), request))
        if request.HasField("temperature") and request.temperature < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature: must be >= 0")
        if request.prompt == "busy":
            context.set_trailing_metadata((("retry-after", "3"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded")
        return text_pb2.TextResponse(text=request.prompt[::-1], token_ids=[1, 2], finish_reason="length")

    def GenerateStream(self, request, context):
        """The prompt back, one character per chunk; for messages, "[number of messages] last content"."""
        self.seen.append((dict(context.invocation_metadata()).get("application"), request))
        text = request.prompt or f"[{len(request.messages)}] {request.messages[-1].content}"
        for i, ch in enumerate(text):
            last = i == len(text) - 1
            yield text_pb2.TextChunk(text=ch, token_ids=[i], finish_reason="length" if last else "")

    def Tokenize(self, request, context):
        self.seen.append((dict(context.invocation_metadata()).get("application"), request))
        return text_pb2.TokenizeResponse(token_ids=list(request.text.encode()))

    def GetModelInfo(self, request, context):
        authorization = dict(context.invocation_metadata()).get("authorization")
        return text_pb2.ModelInfo(model_name=authorization or request.model or "fake-model",
                                  adapters=sorted(self.adapters))

    def LoadAdapter(self, request, context):
        self.seen.append((dict(context.invocation_metadata()).get("application"), request))
        self.adapters.add(request.name)
        return text_pb2.AdaptersResponse(adapters=sorted(self.adapters))

    def UnloadAdapter(self, request, context):
        if request.name not in self.adapters:
            context.abort(grpc.StatusCode.NOT_FOUND, f"adapter: adapter {request.name!r} is not loaded")
        self.adapters.discard(request.name)
        return text_pb2.AdaptersResponse(adapters=sorted(self.adapters))


class FakeGan(gan_pb2_grpc.ImageGanServicer):
    def Sample(self, request, context):
        n = request.num_images if request.HasField("num_images") else 1
        return common_pb2.ImagesResponse(images=[common_pb2.Image(png=png(), width=32, height=32)] * n, seed=5)


@pytest.fixture
def fake_server() -> Iterator[tuple[str, list]]:
    seen: list = []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    text_pb2_grpc.add_TextGenerationServicer_to_server(FakeText(seen), server)
    gan_pb2_grpc.add_ImageGanServicer_to_server(FakeGan(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", seen
    finally:
        server.stop(grace=None)
