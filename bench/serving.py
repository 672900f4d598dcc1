"""Serving overhead: p50/p99 latency of trivial RPCs through the Ray Serve gRPC proxy and of a 16-token text
generation, next to a plain grpc.aio server answering the same trivial RPC in this process.

    .venv/bin/python bench/serving.py                  # starts its own stack on ports 9300-9301
    .venv/bin/python bench/serving.py --address 127.0.0.1:9000 --health-address 127.0.0.1:9001   # a running one

Calls are sequential (one in flight) so the figures are latencies, not throughput. When the bench starts the
stack itself, a last row times the same generation on the engine in-process: the model's share of the total.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from genserve.v1 import text_pb2, text_pb2_grpc  # noqa: E402

from services.client import Client  # noqa: E402
from services.serve import READY_LINE  # noqa: E402

INFO = text_pb2.ModelInfo(model_name="plain", architecture="none", vocab_size=1, max_context=1)


class PlainText(text_pb2_grpc.TextGenerationServicer):
    async def GetModelInfo(self, request, context):
        return INFO


@contextmanager
def plain_server() -> Iterator[str]:
    """A grpc.aio server on its own thread and event loop, answering GetModelInfo with a constant."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        text_pb2_grpc.add_TextGenerationServicer_to_server(PlainText(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


@contextmanager
def serve_stack(port: int) -> Iterator[None]:
    log = Path(f"/tmp/genserve-bench-serving-{port}.log")
    command = [sys.executable, "-m", "services.serve", "--grpc-port", str(port), "--health-port", str(port + 1),
               "--http-port", str(port - 1000), "--metrics-port", str(port - 998)]
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while READY_LINE not in log.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stack did not start, see {log}")
            time.sleep(0.5)
        yield
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def timed(call: Callable[[], object], n: int, warmup: int) -> np.ndarray:
    for _ in range(warmup):
        call()
    out = np.empty(n)
    for i in range(n):
        start = time.perf_counter()
        call()
        out[i] = time.perf_counter() - start
    return out * 1e3


def measure(args: argparse.Namespace) -> list[tuple[str, np.ndarray, str]]:
    rows = []
    with plain_server() as plain_address, grpc.insecure_channel(plain_address) as channel:
        stub = text_pb2_grpc.TextGenerationStub(channel)
        rows.append(("GetModelInfo, plain grpc.aio in-process", timed(
            lambda: stub.GetModelInfo(text_pb2.ModelInfoRequest()), args.n, args.warmup), ""))
    with grpc.insecure_channel(args.health_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        rows.append(("Health/Check, health port (no proxy)", timed(
            lambda: health.Check(health_pb2.HealthCheckRequest()), args.n, args.warmup), ""))
    with Client(args.address, timeout=120) as client:
        rows.append(("GetModelInfo via Serve proxy", timed(client.model_info, args.n, args.warmup), ""))
        rows.append(("Tokenize (5 words) via Serve proxy", timed(
            lambda: client.tokenize("The with statement is used"), args.n, args.warmup), ""))
        tokens: list[int] = []

        def generate() -> None:
            tokens.append(len(client.generate("The with statement", max_tokens=16, temperature=0).token_ids))

        gen = timed(generate, args.n_generate, 2)
        rows.append(("Generate 16 tokens (greedy) via Serve proxy", gen, f"{int(np.median(tokens))} tokens"))
        first: list[float] = []

        def stream() -> None:
            start = time.perf_counter()
            for i, _ in enumerate(client.generate_stream("The with statement", max_tokens=16, temperature=0)):
                if i == 0:
                    first.append((time.perf_counter() - start) * 1e3)

        timed(stream, args.n_generate, 2)
        rows.append(("GenerateStream: time to first chunk", np.array(first[2:]), ""))
    if args.address_is_ours:
        rows.append(engine_in_process(args.n_generate))
    return rows


def engine_in_process(n: int) -> tuple[str, np.ndarray, str]:
    """The same 16-token generation on the engine in this process (the served demo model): the model's share."""
    from services.text.engine import AsyncLLMEngine, SamplingParams

    engine = AsyncLLMEngine.from_dir(os.environ.get("GENSERVE_TEXT_MODEL"))
    prompt = engine.tokenizer.encode("The with statement")
    params = SamplingParams(max_tokens=16, temperature=0)
    tokens: list[int] = []
    ms = timed(lambda: tokens.append(len(engine.generate(prompt, params)[1])), n, 2)
    engine.shutdown()
    return "Generate 16 tokens, engine in-process", ms, f"{int(np.median(tokens))} tokens, no gRPC/Serve"


def table(rows: list[tuple[str, np.ndarray, str]]) -> str:
    base = float(np.median(rows[0][1]))
    lines = [f"| {'call':44} | {'n':>4} | {'p50 ms':>8} | {'p99 ms':>8} | {'p50 / plain':>11} | note",
             f"|{'-' * 46}|{'-' * 6}|{'-' * 10}|{'-' * 10}|{'-' * 13}|------"]
    for name, ms, note in rows:
        p50, p99 = np.percentile(ms, [50, 99])
        lines.append(f"| {name:44} | {len(ms):>4} | {p50:8.2f} | {p99:8.2f} | {p50 / base:10.1f}x | {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a running stack's gRPC address (default: start one on 9300)")
    parser.add_argument("--health-address", help="its health port (default: the gRPC port + 1)")
    parser.add_argument("-n", type=int, default=300, help="calls per trivial RPC")
    parser.add_argument("--n-generate", type=int, default=30, help="calls of the 16-token generation")
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    args.address_is_ours = args.address is None
    if args.address is None:
        args.address = "127.0.0.1:9300"
        args.health_address = args.health_address or "127.0.0.1:9301"
        with serve_stack(9300):
            rows = measure(args)
    else:
        host, port = args.address.rsplit(":", 1)
        args.health_address = args.health_address or f"{host}:{int(port) + 1}"
        rows = measure(args)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
