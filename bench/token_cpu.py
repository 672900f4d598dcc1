"""Where a token's CPU goes through the stack: CPU milliseconds per generated token by process, for the paths table's
chats (bench/chat_paths.py) one after another and 16 at once, over gRPC and over HTTP, and the text replica's
voluntary context switches per token; then what the idle stack costs, in percent of a core per process.

    .venv/bin/python -P bench/token_cpu.py            # starts its own stack on ports 9300-9301 (HTTP 8300)

Read from /proc (psutil) before and after each load. The text replica's two busiest threads are the decode step's
(the engine thread and its OpenMP worker) and are shown apart from the rest of the replica. docs/benchmarks.md, "Where
a token's time goes", holds the figures.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `bench.*`; appended: the checkout never shadows genserve

from bench import chat_paths  # noqa: E402
from bench.serving import serve_stack  # noqa: E402
from genserve.services.client import AsyncClient  # noqa: E402

PORT = 9300
LABELS = (("ServeReplica:text", "text replica, the rest"), ("ProxyActor", "Serve proxy"),
          ("ServeReplica:http", "HTTP ingress replica"), ("ServeController", "Serve controller"),
          ("token_cpu.py", "the client (this bench)"))
OTHER = "the rest of Ray (gcs, raylet, agents, idle replicas)"
TEXT = "ServeReplica:text"
CLOCK = os.sysconf("SC_CLK_TCK")

Snapshot = tuple[dict[int, tuple[str, float]], dict[str, tuple[float, int]]]


def _label(command: str) -> str:
    return next((name for key, name in LABELS if key in command), OTHER)


def _threads(pid: int) -> dict[str, tuple[float, int]]:
    """CPU seconds and voluntary context switches of each thread of `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            switches = int(f.read().split("voluntary_ctxt_switches:")[1].split()[0])
        out[f"{pid}/{tid}"] = ((int(fields[11]) + int(fields[12])) / CLOCK, switches)
    return out


def processes() -> dict[int, tuple[str, float]]:
    """Each live process's command line and CPU seconds so far."""
    out = {}
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            times = p.cpu_times()
            out[p.pid] = (" ".join(p.info["cmdline"] or [p.info["name"]]), times.user + times.system)
        except psutil.Error:  # a process that ended while we looked
            pass
    return out


def snapshot() -> Snapshot:
    labelled, threads = {}, {}
    for pid, (command, cpu) in processes().items():
        labelled[pid] = (_label(command), cpu)
        if TEXT in command:
            try:
                threads |= _threads(pid)
            except (OSError, IndexError):  # it ended while we looked
                pass
    return labelled, threads


def per_token(before: Snapshot, after: Snapshot, tokens: int) -> tuple[dict[str, float], float]:
    """CPU ms per token by label (the decode step's two threads apart), and context switches per token."""
    by: dict[str, float] = {}
    for pid, (label, cpu) in after[0].items():
        if pid in before[0]:
            by[label] = by.get(label, 0.0) + cpu - before[0][pid][1]
    threads = sorted(((after[1][t][0] - before[1][t][0], after[1][t][1] - before[1][t][1])
                      for t in after[1] if t in before[1]), reverse=True)
    step = sum(cpu for cpu, _ in threads[:2])
    by[LABELS[0][1]] = by.get(LABELS[0][1], 0.0) - step
    by = {"decode step threads (2)": step, **by}
    return {k: v / tokens * 1e3 for k, v in by.items()}, sum(s for _, s in threads) / tokens


async def loads() -> list[tuple[str, chat_paths.Run, dict[str, float], float]]:
    from openai import AsyncOpenAI

    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=len(chat_paths.QUESTIONS)))
    rows = []
    async with AsyncClient(f"127.0.0.1:{PORT}", timeout=300) as grpc_client, \
            AsyncOpenAI(base_url=f"http://127.0.0.1:{PORT - 1000}/v1", api_key="none", http_client=http) as openai:
        for protocol, chat in (("gRPC", chat_paths.grpc_chat(grpc_client, 64, 0.7)),
                               ("HTTP", chat_paths.openai_chat(openai, "text", 64, 0.7))):
            await chat_paths.concurrent_run(chat)  # warm-up
            for load, run in (("serial", chat_paths.serial_run), ("16 concurrent", chat_paths.concurrent_run)):
                before = snapshot()
                result = await run(chat)
                ms, switches = per_token(before, snapshot(), result.tokens)
                rows.append((f"{protocol} {load}", result, ms, switches))
    return rows


def idle(seconds: float = 20.0) -> list[tuple[float, str]]:
    """Percent of one core per process of the idle stack, largest first."""
    before = processes()
    time.sleep(seconds)
    after = processes()
    return sorted(((after[p][1] - before[p][1]) / seconds * 100, after[p][0][:60]) for p in after if p in before)[::-1]


def main() -> int:
    with serve_stack(PORT):
        time.sleep(5)
        rows = asyncio.run(loads())
        quiet = idle()
    labels = list(dict.fromkeys(k for _, _, ms, _ in rows for k in ms))
    print("| CPU ms per token | " + " | ".join(name for name, *_ in rows) + " |")
    print("|---|" + "---|" * len(rows))
    print("| tok/s | " + " | ".join(f"{r.rate:.1f}" for _, r, _, _ in rows) + " |")
    for label in labels:
        print(f"| {label} | " + " | ".join(f"{ms.get(label, 0.0):.2f}" for _, _, ms, _ in rows) + " |")
    print("| text replica's voluntary context switches per token | "
          + " | ".join(f"{s:.1f}" for *_, s in rows) + " |")
    print(f"\nidle stack: {sum(p for p, _ in quiet):.1f}% of a core")
    for percent, name in quiet[:12]:
        print(f"  {percent:5.2f}%  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
