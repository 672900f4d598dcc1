"""The same sampled chats down four paths: the engine in-process, the stack over gRPC (the SDK), the stack over HTTP
(the `openai` client) and llama.cpp's `llama-server` over HTTP (the same client), on the same GGUF file.

Each path answers the same 16 chat questions, streamed, sampled at `temperature` with seed i for question i, at most
`max_tokens` tokens each: "serial" is the first 8 one after another (each time to the first token included), and
"concurrent" all 16 at once. Tokens/s counts generated tokens over the wall time of the set; TTFT is the time from
sending a request to the first chunk that carries a token. Issue 30's goals are printed under the table.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

QUESTIONS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a black hole is in two sentences.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
    "What does a compiler do?",
    "Describe a cat to someone who has never seen one.",
    "How do plants make their food?",
    "Name three famous painters and one work of each.",
    "What is the difference between weather and climate?",
    "Write a haiku about autumn leaves.",
    "How does a bicycle stay upright?",
    "Suggest a name for a small coffee shop.",
    "What are prime numbers?",
    "Tell me a fun fact about octopuses.",
    "How should I prepare for a job interview?",
)
SERIAL = 8


@dataclass(frozen=True)
class Run:
    """One set of chats: generated tokens, wall seconds, and each request's seconds to its first token."""

    tokens: int
    seconds: float
    ttft: tuple[float, ...]

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class PathResult:
    name: str
    serial: Run
    concurrent: Run


Chat = Callable[[int], Awaitable[tuple[int, float]]]  # question i -> (tokens, seconds to the first token)


async def serial_run(chat: Chat) -> Run:
    start, tokens, ttft = time.perf_counter(), 0, []
    for i in range(SERIAL):
        n, first = await chat(i)
        tokens += n
        ttft.append(first)
    return Run(tokens, time.perf_counter() - start, tuple(ttft))


async def concurrent_run(chat: Chat) -> Run:
    start = time.perf_counter()
    results = await asyncio.gather(*(chat(i) for i in range(len(QUESTIONS))))
    return Run(sum(n for n, _ in results), time.perf_counter() - start, tuple(f for _, f in results))


def best(runs: list[Run]) -> Run:
    return max(runs, key=lambda r: r.rate)


async def measure_path(name: str, chat: Chat, rounds: int) -> PathResult:
    """A warm-up set, then `rounds` of each kind; the best round of each is kept (the machine's noise only slows)."""
    await concurrent_run(chat)
    serial = best([await serial_run(chat) for _ in range(rounds)])
    concurrent = best([await concurrent_run(chat) for _ in range(rounds)])
    return PathResult(name, serial, concurrent)


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": QUESTIONS[i]}]


# ---- genserve over gRPC ------------------------------------------------------------------------------------------
def grpc_chat(client, max_tokens: int, temperature: float) -> Chat:
    async def chat(i: int) -> tuple[int, float]:
        start, first, tokens = time.perf_counter(), 0.0, 0
        async for chunk in client.generate_stream(messages=messages(i), max_tokens=max_tokens,
                                                  temperature=temperature, seed=i):
            if chunk.token_ids and not tokens:
                first = time.perf_counter() - start
            tokens += len(chunk.token_ids)
        return tokens, first

    return chat


# ---- an OpenAI-compatible server over HTTP (genserve's or llama-server), through the `openai` client --------------
def openai_chat(client, model: str, max_tokens: int, temperature: float) -> Chat:
    """Tokens from the stream's usage chunk; a server without one is counted a token per content chunk (what
    llama-server sends)."""
    async def chat(i: int) -> tuple[int, float]:
        start, first, chunks, usage = time.perf_counter(), 0.0, 0, None
        stream = await client.chat.completions.create(
            model=model, messages=messages(i), max_tokens=max_tokens, temperature=temperature, seed=i, stream=True,
            stream_options={"include_usage": True})
        async for event in stream:
            if event.usage is not None:
                usage = event.usage.completion_tokens
            if event.choices and event.choices[0].delta.content:
                if not chunks:
                    first = time.perf_counter() - start
                chunks += 1
        return (usage if usage is not None else chunks), first

    return chat


# ---- the engine in this process ----------------------------------------------------------------------------------
class InProcess:
    """The served file on `LLMEngine`, stepped in this thread (no event loop, no engine thread): the engine's own
    speed with the serve config's engine settings. Prompts go through the chat template and limits as the text app's
    do (TextIn), so each chat samples the same tokens as over gRPC."""

    def __init__(self, model_path: str, max_tokens: int, temperature: float):
        from genserve.services.common.deploy_config import LOCAL_TEXT_SETTINGS
        from genserve.services.common.device import use_torch_threads
        from genserve.services.text.engine.async_engine import AsyncLLMEngine
        from genserve.services.text.schema import TextIn
        from genserve.services.text.settings import TextArgs

        args = TextArgs(**dict(LOCAL_TEXT_SETTINGS))
        use_torch_threads(args.torch_threads)
        self.engine = AsyncLLMEngine.from_dir(model_path, dtype=args.dtype, config=args.engine_config()).engine
        tokenizer = self.engine.tokenizer
        self.requests = []
        for i in range(len(QUESTIONS)):
            text = tokenizer.apply_chat_template(messages(i))
            ids = tokenizer.encode(text, add_special_tokens=False)
            req = TextIn(messages=messages(i), max_tokens=max_tokens, temperature=temperature, seed=i)
            self.requests.append((ids, req.sampling_params(room=self.engine.max_context - len(ids))))
        self._ids = 0

    def run(self, indices: list[int]) -> tuple[int, float]:
        """Run the chats in `indices` together to the end: (tokens, seconds to each one's first token)."""
        start, tokens, firsts, done = time.perf_counter(), [0] * len(indices), {}, set()
        for slot, i in enumerate(indices):
            def on_delta(delta, slot=slot) -> None:
                if delta.token_ids and slot not in firsts:
                    firsts[slot] = time.perf_counter() - start
                tokens[slot] += len(delta.token_ids)
                if delta.finish_reason is not None:
                    done.add(slot)

            self._ids += 1
            ids, params = self.requests[i]
            self.engine.add_request(f"bench-{self._ids}", ids, params, on_delta, interactive=True)
        while len(done) < len(indices):
            self.engine.step()
        return sum(tokens), [firsts[s] for s in range(len(indices))]

    def serial(self) -> Run:
        start, tokens, ttft = time.perf_counter(), 0, []
        for i in range(SERIAL):
            n, firsts = self.run([i])
            tokens += n
            ttft += firsts
        return Run(tokens, time.perf_counter() - start, tuple(ttft))

    def concurrent(self) -> Run:
        start = time.perf_counter()
        n, firsts = self.run(list(range(len(QUESTIONS))))
        return Run(n, time.perf_counter() - start, tuple(firsts))

    def measure(self, rounds: int) -> PathResult:
        self.concurrent()
        return PathResult("genserve engine in-process (LLMEngine.step)", best([self.serial() for _ in range(rounds)]),
                          best([self.concurrent() for _ in range(rounds)]))


# ---- llama.cpp's server --------------------------------------------------------------------------------------------
def llama_server_binary() -> Path | None:
    """`LLAMA_SERVER` (a path), else `llama-server` on PATH, else None."""
    found = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    return Path(found) if found and Path(found).is_file() else None


@contextmanager
def llama_server(binary: Path, model: Path, port: int, threads: int, slots: int) -> Iterator[str]:
    """`llama-server -np slots -t threads` on 127.0.0.1:port serving `model`; yields its OpenAI base URL."""
    log = Path(f"/tmp/genserve-bench-llama-server-{port}.log")
    command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
               "-t", str(threads), "-tb", str(threads), "-c", str(512 * slots), "--no-webui"]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start, see {log}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


# ---- the table -----------------------------------------------------------------------------------------------------
def table(results: list[PathResult], reference: str) -> str:
    """One row per path, with each figure's ratio to the row named `reference`."""
    ref = next(r for r in results if r.name == reference)
    lines = [f"| path | serial tok/s | / in-process | serial TTFT p50 ms | {len(QUESTIONS)} concurrent tok/s | "
             "/ in-process | concurrent TTFT p50 ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(
            f"| {r.name} | {r.serial.rate:.1f} | {r.serial.rate / ref.serial.rate:.2f}x | "
            f"{np.median(r.serial.ttft) * 1e3:.0f} | {r.concurrent.rate:.1f} | "
            f"{r.concurrent.rate / ref.concurrent.rate:.2f}x | {np.median(r.concurrent.ttft) * 1e3:.0f} |")
    return "\n".join(lines)


def goals(results: dict[str, PathResult]) -> list[str]:
    """Issue 30's goals against the measured rows (a missing row: its goals are not judged)."""
    engine, grpc, http, llama = (results.get(k) for k in ("engine", "grpc", "http", "llama"))
    lines = []

    def judge(text: str, value: float, floor: float, ceiling: bool = False) -> None:
        ok = value <= floor if ceiling else value >= floor
        lines.append(f"{'PASS' if ok else 'MISS'}: {text} {value:.2f}x ({'<=' if ceiling else '>='} {floor}x)")

    if engine:
        for name, path in (("gRPC", grpc), ("HTTP", http)):
            if path:
                judge(f"{name} serial tok/s / in-process", path.serial.rate / engine.serial.rate, 0.85)
                judge(f"{name} concurrent tok/s / in-process", path.concurrent.rate / engine.concurrent.rate, 0.85)
    if http and llama:
        judge("HTTP serial tok/s / llama-server", http.serial.rate / llama.serial.rate, 1.0)
        judge("HTTP serial TTFT p50 / llama-server", float(np.median(http.serial.ttft) / np.median(llama.serial.ttft)),
              1.5, ceiling=True)
        judge("HTTP concurrent tok/s / llama-server", http.concurrent.rate / llama.concurrent.rate, 1.1)
    return lines
