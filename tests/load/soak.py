"""`make soak`: mixed gRPC and HTTP load on a fresh local stack for GENSERVE_SOAK_SECONDS (default 600), every
replica's RSS sampled every few seconds, docs/soak.md and its plot written.

    .venv/bin/python -m tests.load.soak [--seconds 600] [--report docs/soak.md]

The stack runs on 127.0.0.1 on its own port block (gRPC 9300, health 9301, HTTP 8300, metrics 8302;
GENSERVE_SOAK_GRPC_PORT moves it), started and stopped like `make load`'s (tests/load/run.py). The load is the
locustfile's users (tests/load/locustfile.py) at a steady, moderate rate with think time; replica processes are
found through /proc under the stack's process (tests/load/replica_processes.py). Passing: 0 failures and every
replica's RSS within 5% of its post-warm-up level (tests/load/soak_report.py). Raw data stays in runs/soak/.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.load.replica_processes import replicas
from tests.load.report import read_events
from tests.load.run import ROOT, LocalStack, Scenario, locust_command, warm_up
from tests.load.soak_report import RssSample, SoakRun, render_markdown, verdict, write_plot

RUNS = ROOT / "runs" / "soak"
DOCS = ROOT / "docs" / "soak.md"
SAMPLE_PERIOD_S = 5.0
# Steady load with think time: every app busy, no queue overflowing (a shed call would count as a failure).
LOAD = Scenario("soak", users=10, spawn_rate=2, run_time_s=600, think_s=2.0,
                weights="text=3,gan=2,vae=2,diffusion=1,http=2", max_tokens=16, diffusion_steps=4, cooldown_s=0)


def ports(grpc_port: int) -> dict[str, int]:
    """The port block of `grpc_port`, laid out like the e2e stacks' (the locustfile finds HTTP at gRPC - 1000)."""
    return {"grpc": grpc_port, "health": grpc_port + 1, "http": grpc_port - 1000, "metrics": grpc_port - 998}


def warm_up_seconds(run_time_s: float) -> float:
    """A fifth of the run, at most two minutes: first calls, lazy kernels and allocator pools settle in it."""
    return min(120.0, run_time_s / 5)


class RssSampler(threading.Thread):
    """Every replica's RSS under the stack's process, once per `period_s`."""

    def __init__(self, root_pid: int, period_s: float = SAMPLE_PERIOD_S):
        super().__init__(daemon=True)
        self.root_pid = root_pid
        self.period_s = period_s
        self.samples: list[RssSample] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            now = time.time()
            self.samples += [RssSample(now, r.app, r.pid, r.rss_kib) for r in replicas(self.root_pid)]
            self._halt.wait(self.period_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=int(os.environ.get("GENSERVE_SOAK_SECONDS", "600")))
    parser.add_argument("--grpc-port", type=int, default=int(os.environ.get("GENSERVE_SOAK_GRPC_PORT", "9300")))
    parser.add_argument("--report", type=Path, default=DOCS, help="the markdown page; the plot goes to its img/")
    args = parser.parse_args(argv)
    load = dataclasses.replace(LOAD, run_time_s=args.seconds)
    RUNS.mkdir(parents=True, exist_ok=True)
    events_path = RUNS / "requests.jsonl"
    events_path.unlink(missing_ok=True)
    stack = LocalStack(RUNS / "stack.log", 300.0, ports(args.grpc_port))
    print(f"soak: starting the stack: {' '.join(stack.command())}", flush=True)
    try:
        stack.start()
        warm_up(stack.address)
        sampler = RssSampler(stack.process.pid)
        sampler.start()
        print(f"soak: {args.seconds} s of load against {stack.address}", flush=True)
        started = time.time()
        env = os.environ | load.env() | {"GENSERVE_LOAD_LOG": str(events_path)}
        with (RUNS / "locust.log").open("w") as log:
            subprocess.run(locust_command(load, stack.address), cwd=ROOT, env=env, stdout=log,
                           stderr=subprocess.STDOUT)
        load_end = time.time()
        sampler.stop()
    finally:
        stack.stop()
    with (RUNS / "rss.jsonl").open("w") as out:
        out.writelines(json.dumps(dataclasses.asdict(s)) + "\n" for s in sampler.samples)
    (RUNS / "run.json").write_text(json.dumps({"started": started, "load_end": load_end, "seconds": args.seconds}))
    invocation = "make soak" if argv is None and not sys.argv[1:] else "python -m tests.load.soak " + " ".join(
        argv if argv is not None else sys.argv[1:])
    run = SoakRun(invocation, args.seconds, warm_up_seconds(args.seconds), started, load_end, sampler.samples,
                  read_events(events_path))
    image = args.report.parent / "img" / "soak_rss.png"
    write_plot(run, image)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    args.report.write_text(render_markdown(run, image.relative_to(args.report.parent), date))
    ok, reasons = verdict(run)
    print(f"soak: {'PASS' if ok else 'FAIL'}: {'; '.join(reasons)}", flush=True)
    print(f"soak: wrote {args.report} and {image}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
