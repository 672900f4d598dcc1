"""tests/load/locustfile.py run headless for a few seconds against an in-process stand-in of the four services.

locust needs gevent-patched gRPC, so it runs in its own process; its request log shows what it recorded.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from PIL import Image

from genserve.v1 import (
    common_pb2,
    diffusion_pb2_grpc,
    gan_pb2_grpc,
    text_pb2,
    text_pb2_grpc,
    vae_pb2_grpc,
)

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
STEPS = 3


def _check_app(context: grpc.ServicerContext, app: str) -> None:
    """The Serve proxy routes by this metadata; a user that forgets it gets NOT_FOUND."""
    if dict(context.invocation_metadata()).get("application") != app:
        context.abort(grpc.StatusCode.NOT_FOUND, "no application")


class _Text(text_pb2_grpc.TextGenerationServicer):
    def Generate(self, request, context):
        _check_app(context, "text")
        return text_pb2.TextResponse(text="x" * request.max_tokens, finish_reason="length")

    def GenerateStream(self, request, context):
        _check_app(context, "text")
        for _ in range(3):
            time.sleep(0.02)  # the first chunk arrives well before the end
            yield text_pb2.TextChunk(text="x")


class _Gan(gan_pb2_grpc.ImageGanServicer):
    def Sample(self, request, context):
        _check_app(context, "gan")
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")


class _Vae(vae_pb2_grpc.VaeServicer):
    def Reconstruct(self, request, context):
        _check_app(context, "vae")
        sizes = {Image.open(io.BytesIO(image.png)).size for image in request.images}
        if len(request.images) != 2 or sizes != {(32, 32)}:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "images")
        return common_pb2.ImagesResponse(images=request.images)


class _Diffusion(diffusion_pb2_grpc.DiffusionServicer):
    def Generate(self, request, context):
        _check_app(context, "diffusion")
        if request.steps != STEPS or not request.prompt:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "steps")
        return common_pb2.ImagesResponse()


class _OpenAI(http.server.BaseHTTPRequestHandler):
    """The HTTP API's stand-in: chat streams the role chunk, then three content chunks 20 ms apart; images are shed
    with 429."""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/v1/images/generations":
            self.send_response(429)
            self.send_header("retry-after", "1")
            self.end_headers()
            return
        assert self.path == "/v1/chat/completions" and body["stream"] and body["model"] == "text"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
        for _ in range(3):
            time.sleep(0.02)
            self.wfile.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n')
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def http_stand_in() -> str:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


@pytest.fixture
def stand_in() -> str:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    text_pb2_grpc.add_TextGenerationServicer_to_server(_Text(), server)
    gan_pb2_grpc.add_ImageGanServicer_to_server(_Gan(), server)
    vae_pb2_grpc.add_VaeServicer_to_server(_Vae(), server)
    diffusion_pb2_grpc.add_DiffusionServicer_to_server(_Diffusion(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_locust_records_every_rpc_stream_timing_and_shedding(stand_in: str, http_stand_in: str,
                                                              tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    env = os.environ | {
        "GENSERVE_LOAD_LOG": str(log), "GENSERVE_LOAD_THINK_S": "0.05", "GENSERVE_LOAD_DIFFUSION_STEPS": str(STEPS),
        "GENSERVE_LOAD_WEIGHTS": "text=1,gan=1,vae=1,diffusion=1,http=1", "GENSERVE_LOAD_HTTP_URL": http_stand_in,
    }
    command = [
        "timeout", "-k", "5", "60", str(Path(sys.executable).parent / "locust"), "-f", str(LOCUSTFILE),
        "--headless", "-u", "5", "-r", "5", "--run-time", "3s", "--host", stand_in, "--only-summary",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=90)
    assert result.returncode in (0, 1), result.stderr[-2000:]  # 1: locust saw failures (the shed Sample calls)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    codes = {(e["name"], e["code"]) for e in events}
    assert codes == {
        ("TextGeneration/Generate", "OK"),
        ("TextGeneration/GenerateStream", "OK"),
        ("TextGeneration/GenerateStream [first]", "OK"),
        ("ImageGan/Sample [shed]", "RESOURCE_EXHAUSTED"),
        ("Vae/Reconstruct", "OK"),
        ("Diffusion/Generate", "OK"),
        ("HTTP chat.completions (stream)", "OK"),
        ("HTTP chat.completions (stream) [first]", "OK"),
        ("HTTP images.generations [shed]", "RESOURCE_EXHAUSTED"),
    }
    for stream in ("TextGeneration/GenerateStream", "HTTP chat.completions (stream)"):
        first = [e["ms"] for e in events if e["name"] == f"{stream} [first]"]
        total = [e["ms"] for e in events if e["name"] == stream]
        # Three chunks 20 ms apart: the total covers all of them, the first-chunk event only the first.
        assert min(total) >= 40 and statistics.median(first) < statistics.median(total), (stream, first, total)
