"""`make load`: headless locust over gRPC and HTTP against the local CPU stack, replica counts sampled, docs/load.md
written.

    .venv/bin/python -m tests.load.run                      # starts its own stack on 9200 (never 9000/9100)
    .venv/bin/python -m tests.load.run --target 127.0.0.1:9000   # against a running `make serve`

Two scenarios run one after the other on the same stack:
- `mixed`: 60 s of the locustfile's realistic mix; done when nothing fails except deliberate RESOURCE_EXHAUSTED
  and at least one application scales up under load and back down in the cool-down after it;
- `overload`: far more users than the queues admit; done when the excess is answered RESOURCE_EXHAUSTED fast,
  nothing times out or fails otherwise, and no replica dies.
Raw data (one JSON line per request event, per replica sample and per scraped batch-metrics series) stays in
runs/load/<scenario>/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from genserve.services.client import Client
from tests.load.report import (
    BatchSample,
    LoadRun,
    ReplicaSample,
    parse_batch_metrics,
    read_events,
    render_markdown,
    write_batch_plot,
    write_plot,
)

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
LOCUSTFILE = Path("tests/load/locustfile.py")
RUNS = ROOT / "runs" / "load"
DOCS = ROOT / "docs" / "load.md"
# Distinct from `make serve` (9000/9001/8000/8080) and the e2e stack (9100...).
STACK_PORTS = {"grpc": 9200, "health": 9201, "http": 8200, "metrics": 8280}
APPS = ("text", "gan", "vae", "diffusion")
RAY_TEMP = Path("/tmp/ray")
# What the Serve controller logs when a replica dies or stops answering its health check.
REPLICA_TROUBLE = re.compile(r"crashed, marking|marking it unhealthy|died before controller|Health check for .* failed")


@dataclass(frozen=True)
class Scenario:
    name: str
    users: int
    spawn_rate: float
    run_time_s: int
    think_s: float
    weights: str
    max_tokens: int
    diffusion_steps: int
    cooldown_s: int

    def env(self) -> dict[str, str]:
        return {
            "GENSERVE_LOAD_THINK_S": str(self.think_s),
            "GENSERVE_LOAD_WEIGHTS": self.weights,
            "GENSERVE_LOAD_MAX_TOKENS": str(self.max_tokens),
            "GENSERVE_LOAD_DIFFUSION_STEPS": str(self.diffusion_steps),
        }


SCENARIOS = {
    # Realistic requests (48 new tokens, 20 denoising steps): long enough that text and diffusion replicas
    # exceed their target_ongoing_requests and the autoscaler adds a replica.
    "mixed": Scenario("mixed", 16, 4, 60, 0.5, "text=4,gan=2,vae=2,diffusion=2,http=3", 48, 20, 40),
    # 28 diffusion users, more than 2 replicas x max_ongoing_requests + max_queued_requests (24) admit; the other
    # apps keep a light load (2 users each) to show they are unaffected, and leave the proxy a core to shed with.
    "overload": Scenario("overload", 36, 18, 30, 0.5, "text=1,gan=1,vae=1,diffusion=14,http=1", 48, 20, 30),
}


class PeriodicSampler(threading.Thread):
    """Takes a sample once per `period_s` until stopped. A sample lost under load is counted in `errors` and leaves
    a gap in the data; it never fails the run."""

    def __init__(self, period_s: float):
        super().__init__(daemon=True)
        self.period_s = period_s
        self.errors = 0
        self._halt = threading.Event()

    def every_period(self, take: Callable[[float], None]) -> None:
        """`take(started)` once per period (its wall-clock start time) until `stop`."""
        while not self._halt.is_set():
            started = time.time()
            try:
                take(started)
            except Exception:
                self.errors += 1
            self._halt.wait(max(0.0, self.period_s - (time.time() - started)))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


class ReplicaSampler(PeriodicSampler):
    """Asks the `health` app for every application's replicas by state once per `period_s`."""

    def __init__(self, address: str, period_s: float = 1.0):
        super().__init__(period_s)
        self.address = address
        self.samples: list[ReplicaSample] = []

    def run(self) -> None:
        with Client(self.address, timeout=5.0) as client:
            def take(started: float) -> None:
                self.samples += [ReplicaSample(started, app.name, app.status, dict(app.replicas))
                                 for app in client.status().apps if app.name in APPS]
            self.every_period(take)


class BatchSampler(PeriodicSampler):
    """Scrapes the stack's Prometheus endpoint once per `period_s` for the cumulative batch histograms of every
    replica (`ray_genserve_batch_size`, `ray_genserve_batch_wait_seconds`)."""

    def __init__(self, url: str, period_s: float = 1.0):
        super().__init__(period_s)
        self.url = url
        self.samples: list[BatchSample] = []

    def run(self) -> None:
        def take(started: float) -> None:
            with urllib.request.urlopen(self.url, timeout=5) as response:
                text = response.read().decode(errors="replace")
            self.samples += parse_batch_metrics(text, started)
        self.every_period(take)


class LocalStack:
    """`python -m genserve.services.serve` on `ports` (default STACK_PORTS), in its own process group so it can be
    stopped whole."""

    def __init__(self, log_path: Path, timeout_s: float, ports: dict[str, int] | None = None):
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.ports = ports or STACK_PORTS
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def command(self) -> list[str]:
        ports = [f"--{name}-port={port}" for name, port in self.ports.items()]
        return [sys.executable, "-P", "-m", "genserve.services.serve", *ports, f"--timeout={self.timeout_s:.0f}"]

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        # Metrics exported every second (Ray's default is 10 s), so the batch sampler sees them move per second.
        env = {"RAY_metrics_report_interval_ms": "1000"} | os.environ | {
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        }
        self.process = subprocess.Popen(
            self.command(), cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + self.timeout_s + 30
        while time.monotonic() < deadline:
            if "genserve: ready" in self.log_path.read_text():
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"the stack exited ({self.process.returncode}); see {self.log_path}")
            time.sleep(1)
        raise RuntimeError(f"the stack was not ready in {self.timeout_s:.0f} s; see {self.log_path}")

    def controller_logs(self) -> list[Path]:
        """The Serve controller's logs of this stack: Ray names the session after the pid that started it."""
        if self.process is None:
            return []
        return sorted(RAY_TEMP.glob(f"session_*_{self.process.pid}/logs/serve/controller_*.log"))

    def stop(self) -> None:
        """SIGTERM to serve.py (it shuts Serve and Ray down), then SIGKILL to whatever is left of its group."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()


def warm_up(address: str) -> None:
    """One small call per application: first calls pay for lazy initialisation, and a broken app stops the run here."""
    with Client(address, timeout=120.0) as client:
        first = client.gan_sample(1, seed=0).images[0].png
        client.generate("Once upon a time", max_tokens=4, seed=0)
        client.vae_reconstruct([first])
        client.diffuse("a red circle", steps=2, seed=0)


def locust_command(scenario: Scenario, address: str) -> list[str]:
    """Headless locust under `timeout -k`: a hung run is killed instead of blocking `make load`."""
    limit = scenario.run_time_s + 60
    return [
        "timeout", "-k", "10", str(limit), str(VENV_BIN / "locust"), "-f", str(LOCUSTFILE), "--headless",
        "-u", str(scenario.users), "-r", str(scenario.spawn_rate), "--run-time", f"{scenario.run_time_s}s",
        "--stop-timeout", "30", "--host", address, "--only-summary",
    ]


def shown_command(command: list[str]) -> str:
    """The command as docs/load.md prints it: paths inside the checkout relative to it, so the page means the same
    on any machine."""
    def shown(part: str) -> str:
        path = Path(part)
        return str(path.relative_to(ROOT)) if path.is_absolute() and path.is_relative_to(ROOT) else part
    return " ".join(shlex.quote(shown(c)) for c in command)


class ControllerLogWatch:
    """Lines about dying or unhealthy replicas that the controller logs while a scenario runs."""

    def __init__(self, logs: list[Path]):
        self.offsets = {path: path.stat().st_size for path in logs}

    def trouble(self) -> list[str]:
        lines = []
        for path, offset in self.offsets.items():
            with path.open(errors="replace") as log:
                log.seek(offset)
                lines += [line.strip() for line in log if REPLICA_TROUBLE.search(line)]
        return lines


def run_scenario(scenario: Scenario, address: str, out: Path, logs: list[Path], metrics_url: str | None = None
                 ) -> LoadRun:
    out.mkdir(parents=True, exist_ok=True)
    watch = ControllerLogWatch(logs)
    events_path = out / "requests.jsonl"
    events_path.unlink(missing_ok=True)
    sampler = ReplicaSampler(address)
    sampler.start()
    batches = BatchSampler(metrics_url) if metrics_url else None
    if batches is not None:
        batches.start()
    time.sleep(3)  # a few samples of the idle replica counts before the load
    command = locust_command(scenario, address)
    env = os.environ | scenario.env() | {"GENSERVE_LOAD_LOG": str(events_path)}
    started = time.time()
    with (out / "locust.log").open("w") as log:
        returncode = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    load_end = time.time()
    time.sleep(scenario.cooldown_s)  # the autoscaler's downscale delay, then the replicas stopping
    sampler.stop()
    with (out / "replicas.jsonl").open("w") as samples:
        samples.writelines(json.dumps(dataclasses.asdict(sample)) + "\n" for sample in sampler.samples)
    if batches is not None:
        batches.stop()
        with (out / "batches.jsonl").open("w") as samples:
            samples.writelines(json.dumps(dataclasses.asdict(sample)) + "\n" for sample in batches.samples)
    # When the load ran, so the plots can be drawn again from the raw data.
    (out / "run.json").write_text(json.dumps({"started": started, "load_end": load_end,
                                              "cooldown_s": scenario.cooldown_s}))
    return LoadRun(
        scenario=scenario.name,
        command=shown_command(command),
        env=scenario.env(),
        users=scenario.users,
        run_time_s=scenario.run_time_s,
        started=started,
        load_end=load_end,
        events=read_events(events_path),
        replicas=sampler.samples,
        status_errors=sampler.errors,
        locust_returncode=returncode,
        replica_failures=watch.trouble(),
        controller_logs_watched=len(logs),
        batches=batches.samples if batches is not None else [],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="host:port of a running stack (default: start one on 9200)")
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--stack-timeout", type=float, default=300.0, help="seconds for the stack to be ready")
    parser.add_argument("--report", type=Path, default=DOCS, help="the markdown page; plots go to its img/")
    parser.add_argument("--run-time", type=int, help="override every scenario's load duration (s)")
    parser.add_argument("--cooldown", type=int, help="override every scenario's cool-down (s)")
    parser.add_argument("--metrics-url", help="the Prometheus endpoint of a --target stack, for the batch sizes "
                        "(default: the started stack's; none with --target)")
    args = parser.parse_args(argv)
    scenarios = [SCENARIOS[name] for name in args.scenarios]
    if args.run_time:
        scenarios = [replace(s, run_time_s=args.run_time) for s in scenarios]
    if args.cooldown is not None:
        scenarios = [replace(s, cooldown_s=args.cooldown) for s in scenarios]

    stack = None if args.target else LocalStack(RUNS / "stack.log", args.stack_timeout)
    runs: list[LoadRun] = []
    try:
        if stack is not None:
            print(f"load: starting the stack: {' '.join(stack.command())}", flush=True)
            stack.start()
        address = args.target or stack.address
        metrics_url = args.metrics_url or (stack.metrics_url if stack is not None else None)
        warm_up(address)
        for scenario in scenarios:
            print(f"load: scenario {scenario.name} against {address}", flush=True)
            logs = stack.controller_logs() if stack is not None else []
            runs.append(run_scenario(scenario, address, RUNS / scenario.name, logs, metrics_url))
    finally:
        if stack is not None:
            stack.stop()
    for run in runs:
        write_plot(run, args.report.parent / "img" / f"load_{run.scenario}.png")
        if run.batches:
            write_batch_plot(run, args.report.parent / "img" / f"load_{run.scenario}_batch.png")
    invocation = "make load" if argv is None and not sys.argv[1:] else "python -m tests.load.run " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    models = {app: os.environ.get(f"GENSERVE_{app.upper()}_MODEL") or "(committed demo weights)" for app in APPS}
    args.report.write_text(render_markdown(runs, invocation, image_dir=Path("img"), models=models))
    verdicts = [(run.scenario, run.verdict()) for run in runs]
    for name, (ok, reasons) in verdicts:
        print(f"load: {name}: {'PASS' if ok else 'FAIL'}: {'; '.join(reasons)}", flush=True)
    print(f"load: wrote {args.report}", flush=True)
    return 0 if all(ok for _, (ok, _) in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
