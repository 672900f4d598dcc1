"""Serving overhead: p50/p99 latency of trivial RPCs through the Ray Serve gRPC proxy and of a 16-token text
generation, next to a plain grpc.aio server answering the same trivial RPC in this process; then the same streamed
chat over gRPC and over the OpenAI-compatible HTTP API (first token and whole answer); then the paths table
(bench/chat_paths.py, issue 30): 16 sampled chats, one after another and all at once, on the engine in-process,
through the stack over gRPC and over HTTP, and on llama.cpp's `llama-server` with the same GGUF file over the same
OpenAI client, one server after the other, with issue 30's goals judged under it. The llama-server row needs its
binary (`LLAMA_SERVER=path`, or `llama-server` on PATH); docs/benchmarks.md says how to build it.

    .venv/bin/python bench/serving.py                  # starts its own stack on ports 9300-9301 (HTTP 8300)
    .venv/bin/python bench/serving.py --address 127.0.0.1:9000 --health-address 127.0.0.1:9001 \
        --http-url http://127.0.0.1:8000/v1            # a running one
    .venv/bin/python bench/serving.py --batching [--port 9820 | --address ...]   # the image apps' batching only
    .venv/bin/python -P bench/serving.py --tools [--rounds 5]  # a grammar-constrained tool call vs. no tools
    LLAMA_SERVER=.../llama-server .venv/bin/python -P bench/serving.py --paths   # only the paths table

`--batching` prints, side by side, N concurrent one-image requests against one N-image request (GAN Sample and VAE
Reconstruct, N = 32): with dynamic batching (services/common/batcher.py) the ratio approaches 1. A middle row sends
N requests the gan app rejects before any model call: the cost of N requests through the proxy alone. Two diffusion
rows (N = 8, step batching, services/diffusion/step_batcher.py): 20 DDIM steps each, and a mixed set (DDIM and
DPM++(2M) alternating, 10 to 30 steps, guidance 1 to 5; mean 20 steps) against one 8-image request of 20 DDIM steps
at guidance 3.
    .venv/bin/python bench/serving.py --address 127.0.0.1:9000 --tls-ca ca.pem --behind 127.0.0.1:29000 \
        --http-url https://127.0.0.1:8000/v1           # one serving TLS (docs/security.md), and the front's cost

Calls in the latency tables are sequential (one in flight) so the figures are latencies, not throughput. When the
bench starts the stack itself, a last row times the same generation on the engine in-process: the model's share.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # `bench.lm`; appended, so the checkout never shadows an installed package

from bench import chat_paths  # noqa: E402
from genserve.services.client import AsyncClient, Client, ClientTls  # noqa: E402
from genserve.services.client.errors import InvalidArgument  # noqa: E402
from genserve.services.serve import READY_LINE  # noqa: E402
from genserve.v1 import text_pb2, text_pb2_grpc  # noqa: E402

INFO = text_pb2.ModelInfo(model_name="plain", architecture="none", vocab_size=1, max_context=1)
CHAT = [{"role": "user", "content": "Write a short poem about the sea"}]
IMAGE_PROMPT = "a red circle"


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
    command = [sys.executable, "-P", "-m", "genserve.services.serve", "--grpc-port", str(port),
               "--health-port", str(port + 1), "--http-port", str(port - 1000), "--metrics-port", str(port - 998)]
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


def interleaved(calls: dict[str, Callable[[], object]], n: int, warmup: int) -> dict[str, np.ndarray]:
    """Like `timed` for several calls taking turns, so that a loaded machine slows all of them alike."""
    out = {name: np.empty(n) for name in calls}
    for i in range(-warmup, n):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if i >= 0:
                out[name][i] = time.perf_counter() - start
    return {name: ms * 1e3 for name, ms in out.items()}


def front_rows(args: argparse.Namespace) -> list[tuple[str, np.ndarray, str]]:
    """GetModelInfo through the TLS front and on Serve's own proxy behind it (`--behind`), taking turns."""
    with Client(args.address, timeout=120, tls=args.tls) as front, Client(args.behind, timeout=120) as behind:
        ms = interleaved({"front": front.model_info, "behind": behind.model_info}, args.n, args.warmup)
    return [("GetModelInfo via the TLS front (Caddy)", ms["front"], "taking turns with the next row"),
            ("GetModelInfo via Serve proxy behind it", ms["behind"], f"plaintext {args.behind}")]


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
    with Client(args.address, timeout=120, tls=args.tls) as client:
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
    if args.behind:
        rows += front_rows(args)
    if args.address_is_ours:
        with Client(args.address, timeout=60, tls=args.tls) as client:
            served = client.model_info().model_path
        rows.append(engine_in_process(served, args.n_generate))
    return rows


def grpc_chat(client: Client, max_tokens: int) -> tuple[float, float, int]:
    """One streamed chat over gRPC: (ms to the first token, ms to the end, tokens)."""
    start, first, tokens = time.perf_counter(), 0.0, 0
    for chunk in client.generate_stream(messages=CHAT, max_tokens=max_tokens, temperature=0):
        if chunk.token_ids and not tokens:
            first = time.perf_counter() - start
        tokens += len(chunk.token_ids)
    return first * 1e3, (time.perf_counter() - start) * 1e3, tokens


def chat_body(max_tokens: int) -> dict:
    return {"model": "text", "messages": CHAT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


def sse_tokens(line: str) -> int | None:
    """The completion tokens of a stream's usage chunk, else None."""
    if not line.startswith("data: {"):
        return None
    usage = json.loads(line[6:]).get("usage")
    return usage["completion_tokens"] if usage else None


def http_chat(http: httpx.Client, max_tokens: int) -> tuple[float, float, int]:
    """The same chat over HTTP (server-sent events): (ms to the first token, ms to [DONE], tokens)."""
    start, first, tokens = time.perf_counter(), 0.0, 0
    with http.stream("POST", "/chat/completions", json=chat_body(max_tokens)) as response:
        for line in response.iter_lines():
            if not first and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - start
            tokens = sse_tokens(line) or tokens
    return first * 1e3, (time.perf_counter() - start) * 1e3, tokens


def chat_rows(args: argparse.Namespace) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, gRPC ms, HTTP ms) for the first token and the whole answer, calls alternating between protocols."""
    runs: dict[str, list[tuple[float, float, int]]] = {"grpc": [], "http": []}
    with Client(args.address, timeout=120, tls=args.tls) as client, \
            httpx.Client(base_url=args.http_url, timeout=120, verify=args.verify) as http:
        for i in range(args.n_generate + 2):
            g, h = grpc_chat(client, args.chat_tokens), http_chat(http, args.chat_tokens)
            if i >= 2:  # warm-up
                runs["grpc"].append(g)
                runs["http"].append(h)
    tokens = int(np.median([r[2] for r in runs["grpc"]]))
    assert tokens == int(np.median([r[2] for r in runs["http"]])), "the protocols answered differently"
    grpc_ms, http_ms = np.array(runs["grpc"]), np.array(runs["http"])
    return [(f"chat stream, first token ({tokens} tokens)", grpc_ms[:, 0], http_ms[:, 0]),
            (f"chat stream, whole answer ({tokens} tokens)", grpc_ms[:, 1], http_ms[:, 1])]


async def stack_paths(args: argparse.Namespace) -> list[chat_paths.PathResult]:
    """The same chats over gRPC (the SDK) and over HTTP (the `openai` client) through the stack."""
    from openai import AsyncOpenAI

    async with AsyncClient(args.address, timeout=300, tls=args.tls) as client:
        grpc_result = await chat_paths.measure_path(
            "genserve via make serve, gRPC (SDK)",
            chat_paths.grpc_chat(client, args.stream_tokens, args.stream_temperature), args.rounds)
    http = httpx.AsyncClient(verify=args.verify, limits=httpx.Limits(max_connections=len(chat_paths.QUESTIONS)))
    async with AsyncOpenAI(base_url=args.http_url, api_key="none", http_client=http) as client:
        http_result = await chat_paths.measure_path(
            "genserve via make serve, HTTP (openai)",
            chat_paths.openai_chat(client, "text", args.stream_tokens, args.stream_temperature), args.rounds)
    return [grpc_result, http_result]


async def llama_server_path(args: argparse.Namespace, model: Path) -> chat_paths.PathResult | None:
    """llama-server on the same GGUF file with the same chats over the same client, or None with a printed reason."""
    from openai import AsyncOpenAI

    binary = chat_paths.llama_server_binary()
    if binary is None:
        print("llama-server row: skipped (no llama-server: set LLAMA_SERVER to its path; docs/benchmarks.md says how "
              "to build it from the llama-cpp-python sdist)")
        return None
    if model.suffix != ".gguf":
        print(f"llama-server row: skipped (the stack serves {model.name}, not a GGUF file)")
        return None
    slots = len(chat_paths.QUESTIONS)
    with chat_paths.llama_server(binary, model, args.port + 50, args.llama_threads, slots) as url:
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=slots))
        async with AsyncOpenAI(base_url=url, api_key="none", http_client=http) as client:
            return await chat_paths.measure_path(
                f"llama-server -np {slots} -t {args.llama_threads}, HTTP (openai)",
                chat_paths.openai_chat(client, model.stem, args.stream_tokens, args.stream_temperature), args.rounds)


def paths_report(args: argparse.Namespace, stack: list[chat_paths.PathResult], model_path: str) -> str:
    """Issue 30's table: the engine in-process (after the stack, when the bench started it, has stopped), the two
    stack paths, and llama-server (one server after the other), with the goals judged under it."""
    engine = chat_paths.InProcess(model_path, args.stream_tokens, args.stream_temperature)
    results = {"engine": engine.measure(args.rounds)}
    del engine
    results["grpc"], results["http"] = stack
    llama = asyncio.run(llama_server_path(args, Path(model_path)))
    if llama is not None:
        results["llama"] = llama
    rows = list(results.values())
    lines = [f"{len(chat_paths.QUESTIONS)} chat questions, streamed, at most {args.stream_tokens} tokens, temperature "
             f"{args.stream_temperature}, seed i; serial: the first {chat_paths.SERIAL} one after another; best of "
             f"{args.rounds} rounds; model {Path(model_path).name}", "",
             chat_paths.table(rows, rows[0].name), ""]
    return "\n".join(lines + chat_paths.goals(results))


def engine_in_process(model_path: str, n: int) -> tuple[str, np.ndarray, str]:
    """The same 16-token generation on the engine in this process, on the file or folder the stack serves
    (GetModelInfo's model_path): the model's share."""
    from genserve.services.text.engine.async_engine import AsyncLLMEngine
    from genserve.services.text.engine.params import SamplingParams

    engine = AsyncLLMEngine.from_dir(model_path)
    prompt = engine.tokenizer.encode("The with statement")
    params = SamplingParams(max_tokens=16, temperature=0)
    tokens: list[int] = []
    ms = timed(lambda: tokens.append(len(engine.generate(prompt, params)[1])), n, 2)
    engine.shutdown()
    return "Generate 16 tokens, engine in-process", ms, f"{int(np.median(tokens))} tokens, no gRPC/Serve"


TOOL_WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": False}
TOOL_GOAL = 1.15  # issue 32: a grammar-constrained call costs at most this times the time per token without tools


async def _decode_ms_per_token(app: Any, request: Any) -> tuple[float, int]:
    """The replica handler's stream for `request`: ms per token after the first (prefill excluded), and tokens."""
    first, tokens = None, 0
    async for chunk in app.GenerateStream(request):
        if chunk.token_ids and first is None:
            first, tokens = time.perf_counter(), len(chunk.token_ids) - 1
        elif chunk.token_ids:
            tokens += len(chunk.token_ids)
    return 1000 * (time.perf_counter() - first) / max(1, tokens), tokens + 1


def tool_rows(model_path: str | None, rounds: int) -> str:
    """The tools table (issue 32): the same chat streamed by the text replica's own handler (in this process, no
    Ray or gRPC: the grammar's share alone), with tool_choice "required" and without tools, alternating, greedy;
    decode time per token (after the first) of each, their medians and the ratio against the goal."""
    from genserve.services.text import default_model
    from genserve.services.text.app import TextGeneration
    from genserve.v1 import text_pb2

    path = model_path or str(default_model.cached())
    app = TextGeneration.func_or_class(path)
    app.engine.engine.grammars.warm_up()
    messages = [text_pb2.ChatMessage(role="user", content="What is the weather in Paris?")]
    tool = text_pb2.Tool(name="get_weather", description="The current weather in a city.",
                         parameters=json.dumps(TOOL_WEATHER))
    plain = text_pb2.TextRequest(messages=messages, temperature=0, max_tokens=48)
    called = text_pb2.TextRequest(messages=messages, temperature=0, max_tokens=48, tools=[tool],
                                  tool_choice="required")
    engine = app.engine.engine
    jump_forward = engine.config.max_jump_forward
    cases = (("without tools", plain, jump_forward), ("tool_choice required", called, jump_forward),
             ("tool_choice required, jump-forward off", called, 0))
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    counts: dict[str, int] = {}

    async def run() -> None:
        for _ in range(rounds + 1):  # the first round warms every path up and is dropped
            for name, request, max_jump_forward in cases:
                engine.config = dataclasses.replace(engine.config, max_jump_forward=max_jump_forward)
                ms, counts[name] = await _decode_ms_per_token(app, request)
                times[name].append(ms)

    asyncio.run(run())
    app.engine.shutdown()
    base = float(np.median(times["without tools"][1:]))
    lines = [f"Tool calls (issue 32): decode ms per token, {Path(path).name}, replica handler in-process, greedy, "
             f"median of {rounds}", "", "| request | tokens | ms/token | ratio |", "|---|---:|---:|---:|"]
    for name, values in times.items():
        median = float(np.median(values[1:]))
        lines.append(f"| {name} | {counts[name]} | {median:.1f} | {median / base:.2f}x |")
    ratio = float(np.median(times["tool_choice required"][1:])) / base
    lines += ["", f"goal: at most {TOOL_GOAL}x -> {'PASS' if ratio <= TOOL_GOAL else 'FAIL'} ({ratio:.2f}x)"]
    return "\n".join(lines)


def table(rows: list[tuple[str, np.ndarray, str]]) -> str:
    base = float(np.median(rows[0][1]))
    lines = [f"| {'call':44} | {'n':>4} | {'p50 ms':>8} | {'p99 ms':>8} | {'p50 / plain':>11} | note",
             f"|{'-' * 46}|{'-' * 6}|{'-' * 10}|{'-' * 10}|{'-' * 13}|------"]
    for name, ms, note in rows:
        p50, p99 = np.percentile(ms, [50, 99])
        lines.append(f"| {name:44} | {len(ms):>4} | {p50:8.2f} | {p99:8.2f} | {p50 / base:10.1f}x | {note}")
    return "\n".join(lines)


def chat_table(rows: list[tuple[str, np.ndarray, np.ndarray]]) -> str:
    lines = [f"| {'streamed chat':40} | {'n':>4} | {'gRPC p50':>8} | {'gRPC p99':>8} | {'HTTP p50':>8} | "
             f"{'HTTP p99':>8} | HTTP / gRPC (p50) |",
             f"|{'-' * 42}|{'-' * 6}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 10}|-------------------|"]
    for name, grpc_ms, http_ms in rows:
        g50, g99 = np.percentile(grpc_ms, [50, 99])
        h50, h99 = np.percentile(http_ms, [50, 99])
        lines.append(f"| {name:40} | {len(grpc_ms):>4} | {g50:8.2f} | {g99:8.2f} | {h50:8.2f} | {h99:8.2f} | "
                     f"{h50 / g50:16.2f}x |")
    return "\n".join(lines)


async def image_calls(address: str, n: int, one: Callable, many: Callable) -> tuple[float, float]:
    """Seconds for n concurrent one-image calls, and for one n-image call, through the stack."""
    async with AsyncClient(address, timeout=300) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(n)))
        concurrent = time.perf_counter() - start
        start = time.perf_counter()
        await many(client)
        return concurrent, time.perf_counter() - start


def mixed_diffusion(i: int, n: int) -> dict[str, Any]:
    """The i-th of n mixed diffusion requests: DDIM and DPM++(2M) alternating, steps 10..30, guidance 1..5."""
    frac = i / max(n - 1, 1)
    return {"scheduler": ("ddim", "dpmpp_2m")[i % 2], "steps": round(10 + 20 * frac),
            "guidance_scale": round(1 + 4 * frac, 2)}


def batching_rows(address: str, n: int, rounds: int, n_diffusion: int = 8) -> list[tuple[str, int, float, float]]:
    """(case, N, best seconds of N concurrent one-image requests, best seconds of one N-image request)."""
    with Client(address, timeout=120) as client:
        pngs = [image.png for image in client.gan_sample(n, seed=1).images]
    async def rejected(client: AsyncClient, i: int) -> None:
        with contextlib.suppress(InvalidArgument):
            await client.gan_sample(1, seed=i, truncation=0.01)  # INVALID_ARGUMENT before any model call

    cases = {
        "gan Sample": (lambda c, i: c.gan_sample(1, seed=i), lambda c: c.gan_sample(n, seed=0)),
        "gan, rejected requests (serving floor)": (rejected, lambda c: c.gan_sample(n, seed=0)),
        "vae Reconstruct": (lambda c, i: c.vae_reconstruct([pngs[i]]), lambda c: c.vae_reconstruct(pngs)),
    }
    m = n_diffusion
    ddim20 = {"scheduler": "ddim", "steps": 20, "guidance_scale": 3.0}
    diffusion_cases = {
        "diffusion Generate, 20 DDIM steps": (
            lambda c, i: c.diffuse(IMAGE_PROMPT, seed=i, **ddim20),
            lambda c: c.diffuse(IMAGE_PROMPT, num_images=m, seed=0, **ddim20)),
        "diffusion Generate, mixed DDIM/DPM++ 10-30 steps, guidance 1-5": (
            lambda c, i: c.diffuse(IMAGE_PROMPT, seed=i, **mixed_diffusion(i, m)),
            lambda c: c.diffuse(IMAGE_PROMPT, num_images=m, seed=0, **ddim20)),
    }
    rows = []
    for name, (one, many), size in [(k, v, n) for k, v in cases.items()] + \
            [(k, v, m) for k, v in diffusion_cases.items()]:
        asyncio.run(image_calls(address, size, one, many))  # warm-up
        runs = [asyncio.run(image_calls(address, size, one, many)) for _ in range(rounds)]
        rows.append((name, size, min(r[0] for r in runs), min(r[1] for r in runs)))
    return rows


def batching_table(rows: list[tuple[str, int, float, float]]) -> str:
    lines = ["| case | N | N concurrent 1-image requests, ms | one N-image request, ms | ratio |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {n} | {many * 1e3:.0f} | {one * 1e3:.0f} | {many / one:.2f}x |"
              for name, n, many, one in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a running stack's gRPC address (default: start one on 9300)")
    parser.add_argument("--health-address", help="its health port (default: the gRPC port + 1)")
    parser.add_argument("-n", type=int, default=300, help="calls per trivial RPC")
    parser.add_argument("--n-generate", type=int, default=30, help="calls of the 16-token generation")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--http-url", help="the OpenAI-compatible API (default: the stack's, port = gRPC - 1000)")
    parser.add_argument("--chat-tokens", type=int, default=16, help="max_tokens of the sequential streamed chats")
    parser.add_argument("--stream-tokens", type=int, default=64, help="max_tokens of each chat of the paths table")
    parser.add_argument("--stream-temperature", type=float, default=0.7,
                        help="temperature of the paths table's chats (each with its own seed)")
    parser.add_argument("--llama-threads", type=int, default=2, help="threads of the llama-server row")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per path and load (the best is shown)")
    parser.add_argument("--paths", action="store_true", help="only the paths table (in-process, gRPC, HTTP, "
                        "llama-server)")
    parser.add_argument("--batching", action="store_true", help="only the image apps' batching table")
    parser.add_argument("--images", type=int, default=32, help="N of the batching table's GAN and VAE rows")
    parser.add_argument("--diffusion-images", type=int, default=8, help="N of its diffusion rows")
    parser.add_argument("--port", type=int, default=9300, help="gRPC port of the stack the bench starts")
    parser.add_argument("--tools", action="store_true", help="only the tools table: a required tool call's time "
                        "per token against the same chat without tools, on the text replica's handler in-process")
    parser.add_argument("--model", help="with --tools: the GGUF file or checkpoint (default: the default model)")
    parser.add_argument("--tls-ca", metavar="FILE", help="a running stack with TLS: gRPC and HTTPS trusting this CA")
    parser.add_argument("--behind", metavar="ADDR", help="with --tls-ca: Serve's own gRPC proxy behind the front "
                        "(the gRPC port + 20000), timed against the front")
    args = parser.parse_args(argv)
    args.tls = ClientTls(ca=args.tls_ca) if args.tls_ca else None
    args.verify = ssl.create_default_context(cafile=args.tls_ca) if args.tls_ca else True
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.tools:
        print(tool_rows(args.model, args.rounds))
        return 0
    if args.batching:
        if args.address is not None:
            print(batching_table(batching_rows(args.address, args.images, args.rounds, args.diffusion_images)))
            return 0
        with serve_stack(args.port):
            print(batching_table(batching_rows(f"127.0.0.1:{args.port}", args.images, args.rounds,
                                               args.diffusion_images)))
        return 0
    args.address_is_ours = args.address is None
    if args.address is None:
        args.address = f"127.0.0.1:{args.port}"
        args.http_url = args.http_url or f"http://127.0.0.1:{args.port - 1000}/v1"
        args.health_address = args.health_address or f"127.0.0.1:{args.port + 1}"
        with serve_stack(args.port):
            rows, chats, stack, model_path = stack_tables(args)
    else:
        host, port = args.address.rsplit(":", 1)
        args.health_address = args.health_address or f"{host}:{int(port) + 1}"
        args.http_url = args.http_url or f"http://{host}:{int(port) - 1000}/v1"
        rows, chats, stack, model_path = stack_tables(args)
    if rows:
        print(table(rows))
        print()
        print(chat_table(chats))
        print()
    print(paths_report(args, stack, model_path))
    return 0


def stack_tables(args: argparse.Namespace) -> tuple[list, list, list[chat_paths.PathResult], str]:
    """What needs the stack: the latency and chat tables (unless --paths), the two stack paths, the served file."""
    with Client(args.address, timeout=60, tls=args.tls) as client:
        model_path = client.model_info().model_path
    rows, chats = ([], []) if args.paths else (measure(args), chat_rows(args))
    return rows, chats, asyncio.run(stack_paths(args)), model_path

if __name__ == "__main__":
    sys.exit(main())
