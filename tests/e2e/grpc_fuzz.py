"""Protocol fuzzing over gRPC: hypothesis-generated requests for every RPC of the four genserve services, sent to a
running stack one at a time per service, each under a deadline, with every answer tallied by status code.

    .venv/bin/python -m tests.e2e.grpc_fuzz --target 127.0.0.1:9000 --per-service 2000 [--stack-pid PID]

What a run must show (`Run.problems`): no INTERNAL or UNKNOWN status, no status message carrying a traceback or a
file path, and (given the stack's pid) no replica process replaced. The RPCs come from the services' descriptors,
the requests from tests/e2e/grpc_fuzz_strategies.py; `make fuzz` runs it through tests/e2e/test_e2e_grpc_fuzz.py.
Requests of one service go one after another, so the load never makes Serve's autoscaler add or remove replicas
(which would look like a restart); the four services run side by side.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, seed, settings

from genserve.v1 import diffusion_pb2, gan_pb2, text_pb2, vae_pb2
from tests.e2e.grpc_fuzz_strategies import request_strategy
from tests.load.replica_processes import pids_by_app

ROOT = Path(__file__).resolve().parents[2]
# gRPC service -> the Ray Serve application (the `application` metadata) that serves it.
APPLICATIONS = {
    "genserve.v1.TextGeneration": "text",
    "genserve.v1.ImageGan": "gan",
    "genserve.v1.Vae": "vae",
    "genserve.v1.Diffusion": "diffusion",
}
PROTO_MODULES = (text_pb2, gan_pb2, vae_pb2, diffusion_pb2)
# Per call: a legitimate request at the limits (200 denoising steps, 1024 tokens) ends well inside this.
DEADLINE_S = 60.0
# RPCs whose request has no fields: the same empty request, this many times.
EMPTY_REQUEST_CALLS = 3
# Rounds of generation to find a service's share of distinct requests.
MAX_ATTEMPTS = 20
# A status message must never show where the server's code lives or how it failed.
LEAK = re.compile("|".join([
    r"Traceback \(most recent call last\)", r'File "[^"]*", line \d+', re.escape(str(ROOT)), r"site-packages",
    re.escape(sys.prefix), r"/tmp/ray/", r"\.py:\d+",
]))
FAILING_CODES = ("INTERNAL", "UNKNOWN")
CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", 256 * 2**20)]


@dataclass(frozen=True)
class Rpc:
    app: str
    service: str
    method: str
    request: type[Message]
    response: type[Message]
    streaming: bool

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.method}"

    @property
    def name(self) -> str:
        return f"{self.service.rsplit('.', 1)[-1]}/{self.method}"


def rpcs() -> list[Rpc]:
    """Every RPC of the four services, from their descriptors (a new RPC is fuzzed without a change here)."""
    found = []
    for module in PROTO_MODULES:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                found.append(Rpc(
                    APPLICATIONS[service.full_name], service.full_name, method.name,
                    GetMessageClass(method.input_type), GetMessageClass(method.output_type),
                    method.server_streaming,
                ))
    return found


@dataclass(frozen=True)
class Outcome:
    rpc: str
    code: str
    details: str
    seconds: float
    request: str

    @property
    def leaks(self) -> bool:
        return bool(LEAK.search(self.details))

    @property
    def bad(self) -> bool:
        return self.code in FAILING_CODES or self.leaks


def call(channel: grpc.Channel, rpc: Rpc, request: Message, deadline_s: float = DEADLINE_S) -> Outcome:
    """One request, a stream read to its end; the status code name and details the client sees."""
    metadata = (("application", rpc.app),)
    serialize, deserialize = rpc.request.SerializeToString, rpc.response.FromString
    start = time.perf_counter()
    code, details = "OK", ""
    try:
        if rpc.streaming:
            for _ in channel.unary_stream(rpc.path, serialize, deserialize)(request, timeout=deadline_s,
                                                                             metadata=metadata):
                pass
        else:
            channel.unary_unary(rpc.path, serialize, deserialize)(request, timeout=deadline_s, metadata=metadata)
    except grpc.RpcError as error:
        code, details = error.code().name, error.details() or ""
    shown = repr(request)[:300]
    return Outcome(rpc.name, code, details, time.perf_counter() - start, shown)


def generate(rpc: Rpc, count: int, seed_value: int) -> list[Message]:
    """Up to `count` requests for `rpc` from hypothesis (fewer when the strategy has fewer distinct values)."""
    drawn: list[Message] = []

    @seed(seed_value)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(request_strategy(rpc.request))
    def draw(request: Message) -> None:
        drawn.append(request)

    draw()
    return drawn


def requests_for(app_rpcs: list[Rpc], per_service: int, seed_value: int) -> list[tuple[Rpc, Message]]:
    """At least `per_service` distinct requests over the service's RPCs, shared evenly among those whose request
    has fields; hypothesis is asked again under new seeds until each has its share (it repeats simple values)."""
    plan: list[tuple[Rpc, Message]] = []
    fuzzable = [r for r in app_rpcs if r.request.DESCRIPTOR.fields]
    for rpc in app_rpcs:
        if not rpc.request.DESCRIPTOR.fields:
            plan += [(rpc, rpc.request())] * EMPTY_REQUEST_CALLS
    share = math.ceil(max(0, per_service - len(plan)) / max(1, len(fuzzable)))
    for index, rpc in enumerate(fuzzable):
        distinct: dict[bytes, Message] = {}
        for attempt in range(MAX_ATTEMPTS):
            for request in generate(rpc, share, seed_value + 1000 * index + attempt):
                distinct.setdefault(request.SerializeToString(), request)
            if len(distinct) >= share:
                break
        plan += [(rpc, request) for request in list(distinct.values())[:share]]
    return plan


@dataclass
class Tally:
    app: str
    codes: Counter = field(default_factory=Counter)
    slowest_s: float = 0.0
    bad: list[Outcome] = field(default_factory=list)
    restarts: int | None = None
    health_after: str = ""

    @property
    def sent(self) -> int:
        return sum(self.codes.values())

    def add(self, outcome: Outcome) -> None:
        self.codes[outcome.code] += 1
        self.slowest_s = max(self.slowest_s, outcome.seconds)
        if outcome.bad:
            self.bad.append(outcome)


def health(address: str, app: str) -> str:
    """The app's own grpc.health.v1 answer: the text app says NOT_SERVING once its engine loop has failed, before
    Ray's health check replaces the replica."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30,
                                                              metadata=(("application", app),))
        except grpc.RpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def fuzz_service(address: str, plan: list[tuple[Rpc, Message]], tally: Tally,
                 progress: Callable[[str], None] | None = None) -> Tally:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        for index, (rpc, request) in enumerate(plan, 1):
            tally.add(call(channel, rpc, request))
            if progress is not None and index % 500 == 0:
                progress(f"fuzz: {tally.app}: {index}/{len(plan)} sent")
    return tally


@dataclass
class Run:
    tallies: dict[str, Tally]
    seconds: float
    seed: int

    def problems(self) -> list[str]:
        out = []
        for tally in self.tallies.values():
            out += [f"{o.rpc}: {o.code} {o.details!r} <- {o.request}" for o in tally.bad]
            if tally.restarts:
                out.append(f"{tally.app}: {tally.restarts} replica(s) replaced during the run")
            if tally.health_after != "SERVING":
                out.append(f"{tally.app}: health after the run is {tally.health_after}")
        return out

    def table(self) -> str:
        """Markdown: one row per service, one column per status code seen (INTERNAL always)."""
        codes = sorted({c for t in self.tallies.values() for c in t.codes} - {"OK", "INTERNAL"})
        head = ["service", "sent", "OK", *codes, "INTERNAL", "leaky messages", "restarts", "health after",
                "slowest call (s)"]
        lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
        for tally in self.tallies.values():
            leaks = sum(o.leaks for o in tally.bad)
            restarts = "-" if tally.restarts is None else str(tally.restarts)
            cells = [tally.app, tally.sent, tally.codes["OK"], *(tally.codes[c] for c in codes),
                     tally.codes["INTERNAL"], leaks, restarts, tally.health_after, f"{tally.slowest_s:.1f}"]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        return "\n".join(lines)


def fuzz(address: str, per_service: int, seed_value: int = 0, stack_pid: int | None = None,
         apps: Iterable[str] = tuple(APPLICATIONS.values()),
         progress: Callable[[str], None] | None = None) -> Run:
    """Generate the requests, send each service's in its own thread, and compare the replicas before and after."""
    apps = list(apps)
    plans = {app: requests_for([r for r in rpcs() if r.app == app], per_service, seed_value) for app in apps}
    before = pids_by_app(stack_pid) if stack_pid else None
    start = time.perf_counter()
    with ThreadPoolExecutor(len(apps)) as pool:
        futures = {app: pool.submit(fuzz_service, address, plans[app], Tally(app), progress) for app in apps}
        tallies = {app: future.result() for app, future in futures.items()}
    seconds = time.perf_counter() - start
    for app, tally in tallies.items():
        tally.health_after = health(address, app)
    if before is not None:
        after = pids_by_app(stack_pid)
        for app, tally in tallies.items():
            tally.restarts = len(before.get(app, set()) - after.get(app, set()))
    return Run(tallies, seconds, seed_value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="host:port of a running stack's gRPC proxy")
    parser.add_argument("--per-service", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stack-pid", type=int,
                        help="the stack's `genserve.services.serve` pid, to count replica restarts")
    parser.add_argument("--apps", nargs="+", choices=list(APPLICATIONS.values()), default=list(APPLICATIONS.values()))
    args = parser.parse_args(argv)
    run = fuzz(args.target, args.per_service, args.seed, args.stack_pid, args.apps,
               progress=lambda line: print(line, flush=True))
    print(run.table())
    print(f"{sum(t.sent for t in run.tallies.values())} requests in {run.seconds:.0f} s (seed {run.seed})")
    for problem in run.problems():
        print("PROBLEM:", problem)
    return 1 if run.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
