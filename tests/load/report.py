"""Turns a load run (request events + replica samples + batch metrics) into tables, verdicts, plots and docs/load.md.

Request events come from the locustfile's GENSERVE_LOAD_LOG: one per finished RPC (`name`), one per stream's
first message (`name [first]`, the time to first token), and RESOURCE_EXHAUSTED answers under `name [shed]`.
Batch samples are scrapes of the stack's Prometheus endpoint: the cumulative `ray_genserve_batch_size` and
`ray_genserve_batch_wait_seconds` histograms and the `ray_genserve_batch_images_total` counter of every replica
(services/common/metrics.py). Ray exports a histogram's `_sum` rebuilt from bucket midpoints (a call of 4 images
adds 3), so images come from the counter; `_sum` stands in, marked approximate, only where the counter is missing.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

FIRST_SUFFIX = " [first]"
SHED_SUFFIX = " [shed]"
SHED_CODE = "RESOURCE_EXHAUSTED"
# gRPC service (the first part of an RPC name) -> Ray Serve application.
APPLICATIONS = {"TextGeneration": "text", "ImageGan": "gan", "Vae": "vae", "Diffusion": "diffusion"}
# Images per model call when nothing is batched: one request of the locustfile (GAN Sample of 4, VAE Reconstruct of
# 2; diffusion of 1 per U-Net step, whose latents the VAE decodes one request at a time).
UNBATCHED_IMAGES = {"gan generate": 4, "vae reconstruct": 2, "vae decode": 1, "diffusion Generate": 1}


@dataclass(frozen=True)
class RequestEvent:
    t: float
    name: str
    ms: float
    code: str


@dataclass(frozen=True)
class ReplicaSample:
    t: float
    app: str
    status: str
    replicas: dict[str, int]

    @property
    def running(self) -> int:
        return self.replicas.get("RUNNING", 0)


@dataclass(frozen=True)
class BatchSample:
    """One replica's cumulative batch metrics for one (service, method) at scrape time `t`: `sum`/`count` of
    `ray_genserve_batch_size` (images as Ray's bucket midpoints, model calls), its cumulative `buckets` (upper
    bound as written by `bucket_key` -> calls with at most that many images), `wait_sum`/`wait_count` of
    `ray_genserve_batch_wait_seconds` (seconds, again from midpoints, and requests), and `images`, the exact
    `ray_genserve_batch_images_total` (None where the stack does not export it)."""

    t: float
    service: str
    method: str
    replica: str
    sum: float
    count: float
    buckets: dict[str, float]
    wait_sum: float = 0.0
    wait_count: float = 0.0
    images: float | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return self.service, self.method, self.replica


@dataclass(frozen=True)
class BatchStats:
    """Model calls of one (service, method), the images they carried, calls with at most one image, batch waits and
    their seconds; `exact` unless the images are the histogram's midpoint `_sum`."""

    service: str
    method: str
    calls: float = 0.0
    images: float = 0.0
    single: float = 0.0
    wait_s: float = 0.0
    waits: float = 0.0
    exact: bool = True

    def merged(self, other: BatchStats) -> BatchStats:
        """Both summed; midpoint images make the sum inexact only where they came with model calls."""
        return BatchStats(self.service, self.method, self.calls + other.calls, self.images + other.images,
                          self.single + other.single, self.wait_s + other.wait_s, self.waits + other.waits,
                          (self.exact or not self.calls) and (other.exact or not other.calls))

    @property
    def mean(self) -> float:
        return self.images / self.calls if self.calls else math.nan

    @property
    def batched_share(self) -> float:
        """Share of model calls that carried more than one image."""
        return 1 - self.single / self.calls if self.calls else math.nan

    @property
    def mean_wait_ms(self) -> float:
        return 1000 * self.wait_s / self.waits if self.waits else math.nan


@dataclass(frozen=True)
class BatchDelta:
    """What one series gained between two scrapes (or since it appeared); `t` is the later scrape."""

    t: float
    stats: BatchStats


@dataclass(frozen=True)
class RpcStats:
    name: str
    ok: int
    rps: float
    p50: float
    p95: float
    p99: float
    failed: int
    shed: int
    shed_p50: float
    shed_p99: float


@dataclass(frozen=True)
class Scaling:
    app: str
    before: int
    peak: int
    after: int
    up_at_s: float | None
    down_at_s: float | None

    @property
    def scaled_up_and_down(self) -> bool:
        return self.peak > self.before and self.after < self.peak


@dataclass
class LoadRun:
    scenario: str
    command: str
    env: dict[str, str]
    users: int
    run_time_s: float
    started: float
    load_end: float
    events: list[RequestEvent]
    replicas: list[ReplicaSample]
    status_errors: int = 0
    locust_returncode: int = 0
    replica_failures: list[str] = field(default_factory=list)
    controller_logs_watched: int = 0
    batches: list[BatchSample] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        """Wall time of the locust process (its start-up and stop included)."""
        return self.load_end - self.started

    def rpc_stats(self) -> list[RpcStats]:
        return rpc_stats(self.events, self.run_time_s)

    def failures_by_code(self) -> dict[str, Counter]:
        return failures_by_code(self.events)

    def scaling(self) -> list[Scaling]:
        return scaling(self.replicas, self.started, self.load_end)

    def verdict(self) -> tuple[bool, list[str]]:
        return verdict(self)


def read_events(path: Path) -> list[RequestEvent]:
    if not path.exists():
        return []
    return [RequestEvent(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


BATCH_SIZE = "ray_genserve_batch_size"
BATCH_WAIT = "ray_genserve_batch_wait_seconds"
BATCH_IMAGES = "ray_genserve_batch_images_total"
_SERIES = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def read_batches(path: Path) -> list[BatchSample]:
    if not path.exists():
        return []
    return [BatchSample(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def bucket_key(le: str) -> str:
    """A bucket's upper bound, the same however the exporter writes it: "1.0" and "1" -> "1", "+Inf" -> "+Inf"."""
    bound = float(le)
    return "+Inf" if math.isinf(bound) else f"{bound:g}"


def parse_batch_metrics(text: str, t: float) -> list[BatchSample]:
    """The batch histograms in a Prometheus text exposition, one BatchSample per (service, method, replica).

    Series without a `service` label are skipped; a series without a `replica` label is told apart by its other
    labels instead."""
    series: dict[tuple[str, str, str], dict] = {}
    for line in text.splitlines():
        if not line.startswith((BATCH_SIZE + "_", BATCH_WAIT + "_", BATCH_IMAGES)):
            continue
        match = _SERIES.match(line.strip())
        if match is None:
            continue
        name, value = match["name"], float(match["value"])
        labels = dict(_LABEL.findall(match["labels"] or ""))
        if "service" not in labels:
            continue
        le = labels.pop("le", None)
        replica = labels.get("replica") or ",".join(
            f"{k}={v}" for k, v in sorted(labels.items()) if k not in ("service", "method")
        )
        entry = series.setdefault((labels["service"], labels.get("method", ""), replica), {
            "sum": 0.0, "count": 0.0, "buckets": {}, "wait_sum": 0.0, "wait_count": 0.0, "images": None,
        })
        if name == BATCH_SIZE + "_sum":
            entry["sum"] = value
        elif name == BATCH_SIZE + "_count":
            entry["count"] = value
        elif name == BATCH_SIZE + "_bucket" and le is not None:
            entry["buckets"][bucket_key(le)] = value
        elif name == BATCH_WAIT + "_sum":
            entry["wait_sum"] = value
        elif name == BATCH_WAIT + "_count":
            entry["wait_count"] = value
        elif name == BATCH_IMAGES:
            entry["images"] = value
    return [
        BatchSample(t, service, method, replica, **entry)
        for (service, method, replica), entry in sorted(series.items())
        if entry["count"] or entry["wait_count"] or entry["buckets"]
    ]


def batch_deltas(samples: list[BatchSample]) -> list[BatchDelta]:
    """Per series (one replica's service and method), what it gained from each scrape to the next.

    The first scrape is the baseline (what warm-up and earlier scenarios left); a series that first appears later
    belongs to a replica started since, so all of it counts; a value that went down is a restarted replica's
    counters, counted from zero; a series that disappears (a replica stopped) adds nothing more."""
    if not samples:
        return []
    first_t = min(s.t for s in samples)
    last: dict[tuple[str, str, str], BatchSample] = {}
    deltas = []
    for sample in sorted(samples, key=lambda s: s.t):
        before = last.get(sample.key)
        last[sample.key] = sample
        if before is None and sample.t == first_t:
            continue
        if before is None or sample.count < before.count or sample.wait_count < before.wait_count:
            before = BatchSample(sample.t, sample.service, sample.method, sample.replica, 0.0, 0.0, {}, images=0.0)
        calls = sample.count - before.count
        waits = sample.wait_count - before.wait_count
        if not calls and not waits:
            continue
        exact = sample.images is not None and before.images is not None
        deltas.append(BatchDelta(sample.t, BatchStats(
            service=sample.service, method=sample.method, calls=calls,
            images=sample.images - before.images if exact else sample.sum - before.sum,
            single=sample.buckets.get("1", 0.0) - before.buckets.get("1", 0.0),
            wait_s=sample.wait_sum - before.wait_sum, waits=waits, exact=exact,
        )))
    return deltas


def batch_stats(samples: list[BatchSample], start: float | None = None, end: float | None = None) -> list[BatchStats]:
    """Per (service, method), what the scrapes with `start` < t <= `end` added: the table of docs/load.md."""
    totals: dict[tuple[str, str], BatchStats] = {}
    for delta in batch_deltas(samples):
        if (start is not None and delta.t <= start) or (end is not None and delta.t > end):
            continue
        key = (delta.stats.service, delta.stats.method)
        totals[key] = totals.get(key, BatchStats(*key)).merged(delta.stats)
    return [totals[key] for key in sorted(totals)]


def batch_timeline(samples: list[BatchSample], started: float, end: float, bin_s: float = 3.0) -> dict[str, list]:
    """Per time bin since `started`: `t` (the bin's middle), and per "<service> <method>" `mean:<service> <method>`
    (Δimages / Δmodel calls, NaN without calls) and `calls:<service> <method>` (model calls/s)."""
    n_bins = max(1, math.ceil((end - started) / bin_s))
    images: dict[str, list[float]] = defaultdict(lambda: [0.0] * n_bins)
    calls: dict[str, list[float]] = defaultdict(lambda: [0.0] * n_bins)
    for delta in batch_deltas(samples):
        index = math.ceil((delta.t - started) / bin_s) - 1  # a scrape closes the interval it ends
        if 0 <= index < n_bins and delta.stats.calls:
            name = f"{delta.stats.service} {delta.stats.method}"
            images[name][index] += delta.stats.images
            calls[name][index] += delta.stats.calls
    series: dict[str, list] = {"t": [(i + 0.5) * bin_s for i in range(n_bins)]}
    for name in sorted(calls):
        series[f"mean:{name}"] = [i / c if c else math.nan for i, c in zip(images[name], calls[name], strict=True)]
        series[f"calls:{name}"] = [c / bin_s for c in calls[name]]
    return series


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def base_name(name: str) -> str:
    return name.removesuffix(SHED_SUFFIX)


def rpc_stats(events: list[RequestEvent], duration_s: float) -> list[RpcStats]:
    """One row per RPC (and one per stream's first message); shed answers are counted apart from failures."""
    groups: dict[str, list[RequestEvent]] = defaultdict(list)
    for event in events:
        groups[base_name(event.name)].append(event)
    rows = []
    for name in sorted(groups):
        ok = [e.ms for e in groups[name] if e.code == "OK"]
        shed = [e.ms for e in groups[name] if e.code == SHED_CODE]
        failed = sum(1 for e in groups[name] if e.code not in ("OK", SHED_CODE))
        rows.append(RpcStats(
            name=name, ok=len(ok), rps=len(ok) / duration_s if duration_s > 0 else math.nan,
            p50=percentile(ok, 50), p95=percentile(ok, 95), p99=percentile(ok, 99), failed=failed,
            shed=len(shed), shed_p50=percentile(shed, 50), shed_p99=percentile(shed, 99),
        ))
    return rows


def failures_by_code(events: list[RequestEvent]) -> dict[str, Counter]:
    """status code -> Counter of RPC names, for every answer that was not OK."""
    table: dict[str, Counter] = defaultdict(Counter)
    for event in events:
        if event.code != "OK":
            table[event.code][base_name(event.name)] += 1
    return dict(table)


def scaling(samples: list[ReplicaSample], started: float, load_end: float) -> list[Scaling]:
    """Per app: RUNNING replicas before the load, the peak, the count at the end, when it rose and fell back."""
    rows = []
    for app in sorted({s.app for s in samples}):
        series = sorted((s for s in samples if s.app == app), key=lambda s: s.t)
        before_samples = [s.running for s in series if s.t <= started] or [series[0].running]
        before = before_samples[-1]
        peak = max(s.running for s in series)
        peak_at = next(s.t for s in series if s.running == peak)
        up = next((s.t for s in series if s.running > before), None)
        down = None if up is None else next((s.t for s in series if s.t > peak_at and s.running < peak), None)
        rows.append(Scaling(
            app=app, before=before, peak=peak, after=series[-1].running,
            up_at_s=None if up is None else up - started, down_at_s=None if down is None else down - started,
        ))
    return rows


def unhealthy_samples(samples: list[ReplicaSample]) -> list[ReplicaSample]:
    return [s for s in samples if s.status in ("UNHEALTHY", "DEPLOY_FAILED")]


def verdict(run: LoadRun) -> tuple[bool, list[str]]:
    """Whether the run meets its scenario's done-when, with the reasons in words."""
    failures = run.failures_by_code()
    real = {code: sum(c.values()) for code, c in failures.items() if code != SHED_CODE}
    shed = sum(failures.get(SHED_CODE, Counter()).values())
    served = sum(1 for e in run.events if e.code == "OK" and not e.name.endswith(FIRST_SUFFIX))
    reasons = [f"{served} requests served, {shed} shed (RESOURCE_EXHAUSTED), other failures {real or 0}"]
    ok = served > 0 and not real and run.locust_returncode in (0, 1)
    unhealthy = unhealthy_samples(run.replicas)
    if unhealthy or run.replica_failures:
        ok = False
        reasons.append(f"replica trouble: {len(unhealthy)} unhealthy samples; {run.replica_failures}")
    elif run.controller_logs_watched:
        reasons.append("no replica died (no app UNHEALTHY, no crash or failed health check in the controller log)")
    else:
        reasons.append("no app was ever UNHEALTHY (the controller log was not available to check for deaths)")
    if run.scenario == "mixed":
        scaled = [s.app for s in run.scaling() if s.scaled_up_and_down]
        ok = ok and bool(scaled)
        reasons.append(f"scaled up under load and back down: {', '.join(scaled) or 'none'}")
    else:
        # Fast means refused without queueing: even the slowest 1% of refusals beat the median served request of
        # the same RPC (absolute numbers on a saturated 2-core machine say more about the CPU than the server).
        shed_rows = [row for row in run.rpc_stats() if row.shed]
        fast = bool(shed_rows) and all(row.ok and row.shed_p99 < row.p50 for row in shed_rows)
        ok = ok and fast
        detail = "; ".join(
            f"{row.name}: shed p50 {row.shed_p50:.0f} / p99 {row.shed_p99:.0f} ms vs served p50 {row.p50:.0f} ms"
            for row in shed_rows
        )
        reasons.append(f"shed answers {'fast' if fast else 'NOT fast'}: {detail or 'nothing was shed'}")
    return ok, reasons


def application(name: str) -> str:
    return APPLICATIONS.get(name.split("/", 1)[0], name)


def timeline(run: LoadRun, bin_s: float = 2.0) -> dict[str, list[float]]:
    """Per time bin since the start: served/s, shed/s, failed/s, p50 and p95 latency of served RPCs (ms), and
    `p50:<app>`, the p50 of each application's served RPCs."""
    end = max([run.load_end] + [s.t for s in run.replicas])
    n_bins = max(1, math.ceil((end - run.started) / bin_s))
    served: list[list[float]] = [[] for _ in range(n_bins)]
    per_app: dict[str, list[list[float]]] = defaultdict(lambda: [[] for _ in range(n_bins)])
    shed = [0] * n_bins
    failed = [0] * n_bins
    for event in run.events:
        index = int((event.t - run.started) // bin_s)
        if not 0 <= index < n_bins or event.name.endswith(FIRST_SUFFIX):
            continue
        if event.code == "OK":
            served[index].append(event.ms)
            per_app[application(event.name)][index].append(event.ms)
        elif event.code == SHED_CODE:
            shed[index] += 1
        else:
            failed[index] += 1
    series = {
        "t": [(i + 0.5) * bin_s for i in range(n_bins)],
        "served": [len(b) / bin_s for b in served],
        "shed": [c / bin_s for c in shed],
        "failed": [c / bin_s for c in failed],
        "p50": [percentile(b, 50) for b in served],
        "p95": [percentile(b, 95) for b in served],
    }
    for app, bins in sorted(per_app.items()):
        series[f"p50:{app}"] = [percentile(b, 50) for b in bins]
    return series


def write_plot(run: LoadRun, path: Path) -> None:
    """Three panels over time: throughput (served/shed/failed), latency (p50 per app, p95 of all), RUNNING replicas
    per app (thinner lines on top, so apps with the same count stay visible)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = timeline(run)
    fig, (ax_rps, ax_lat, ax_rep) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    ax_rps.plot(series["t"], series["served"], label="served/s")
    ax_rps.plot(series["t"], series["shed"], label="RESOURCE_EXHAUSTED/s")
    ax_rps.plot(series["t"], series["failed"], label="other failures/s")
    ax_rps.set_ylabel("requests/s")
    colors = _colors()
    ax_lat.plot(series["t"], series["p95"], color="black", linestyle=":", label="p95, all RPCs")
    for app in sorted(APPLICATIONS.values()):
        if f"p50:{app}" in series:
            ax_lat.plot(series["t"], series[f"p50:{app}"], color=colors[app], label=f"p50 {app}")
    ax_lat.set_ylabel("latency (ms)")
    ax_lat.set_yscale("log")
    for width, app in enumerate(sorted({s.app for s in run.replicas})):
        points = sorted((s.t - run.started, s.running) for s in run.replicas if s.app == app)
        ax_rep.step([p[0] for p in points], [p[1] for p in points], where="post", label=app, color=colors.get(app),
                    linewidth=5 - width)
    ax_rep.set_ylabel("RUNNING replicas")
    ax_rep.set_xlabel("seconds since the load started")
    ax_rep.yaxis.get_major_locator().set_params(integer=True)
    for ax in (ax_rps, ax_lat, ax_rep):
        ax.axvspan(0, run.duration_s, color="0.92", zorder=0)
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"genserve load, scenario {run.scenario} ({run.users} users; shaded: load on)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _colors() -> dict[str, str]:
    return dict(zip(sorted(APPLICATIONS.values()), ("tab:purple", "tab:orange", "tab:green", "tab:red"), strict=True))


def write_batch_plot(run: LoadRun, path: Path, bin_s: float = 3.0) -> None:
    """Two panels over time, per batching service and method: mean images per model call
    (Δ`genserve_batch_images` / Δcount of `genserve_batch_size` per `bin_s` bin; dotted: one request's images,
    nothing batched) and model calls/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max([run.load_end] + [s.t for s in run.batches])
    series = batch_timeline(run.batches, run.started, end, bin_s)
    colors = _colors()
    fig, (ax_mean, ax_calls) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    names = sorted(key.removeprefix("mean:") for key in series if key.startswith("mean:"))
    for name in names:
        service = name.split(" ", 1)[0]
        color = colors.get(service)
        style = "--" if sum(n.startswith(service + " ") for n in names[:names.index(name)]) else "-"
        ax_mean.plot(series["t"], series[f"mean:{name}"], marker=".", color=color, linestyle=style, label=name)
        if name in UNBATCHED_IMAGES:
            ax_mean.axhline(UNBATCHED_IMAGES[name], color=color, linestyle=":", linewidth=1)
        ax_calls.plot(series["t"], series[f"calls:{name}"], color=color, linestyle=style, label=name)
    ax_mean.set_ylabel("images per model call")
    ax_mean.set_ylim(bottom=0)
    ax_calls.set_ylabel("model calls/s")
    ax_calls.set_xlabel("seconds since the load started")
    for ax in (ax_mean, ax_calls):
        ax.axvspan(0, run.duration_s, color="0.92", zorder=0)
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"genserve batching, scenario {run.scenario} (mean per {bin_s:g} s; dotted: unbatched; "
                 "shaded: load on)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


def render_run(run: LoadRun, image_dir: Path) -> list[str]:
    ok, reasons = run.verdict()
    env = " ".join(f"{k}={v}" for k, v in sorted(run.env.items()))
    lines = [
        f"## Scenario `{run.scenario}`: {'PASS' if ok else 'FAIL'}",
        "",
        *[f"- {reason}" for reason in reasons],
        "",
        "Locust command (the runner sets these environment variables):",
        "",
        "```",
        f"{env} \\",
        f"  {run.command}",
        "```",
        "",
        f"Load for {run.run_time_s:.0f} s with {run.users} users (RPS = served / that time). Latencies are "
        "client-side, in ms, over served requests; `[first]` rows are the first message of a stream (time to first "
        "token for text). Shed answers (RESOURCE_EXHAUSTED) are counted apart, with their own latency.",
        "",
        "| RPC | served | RPS | p50 | p95 | p99 | failed | shed | shed p50 | shed p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in run.rpc_stats():
        lines.append(
            f"| {row.name} | {row.ok} | {row.rps:.2f} | {_ms(row.p50)} | {_ms(row.p95)} | {_ms(row.p99)} "
            f"| {row.failed} | {row.shed} | {_ms(row.shed_p50)} | {_ms(row.shed_p99)} |"
        )
    lines += ["", "Answers other than OK, by gRPC status code (HTTP: 429 as RESOURCE_EXHAUSTED, else HTTP_<status>):",
              ""]
    failures = run.failures_by_code()
    if failures:
        lines += ["| code | count | RPCs |", "|---|---:|---|"]
        for code, names in sorted(failures.items()):
            detail = ", ".join(f"{name} {count}" for name, count in names.most_common())
            lines.append(f"| {code} | {sum(names.values())} | {detail} |")
    else:
        lines.append("none.")
    lines += [
        "",
        "RUNNING replicas per application (sampled every second through the `health` app's GetStatus):",
        "",
        "| app | before | peak | at the end | first scale-up (s) | back down (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in run.scaling():
        up = "-" if row.up_at_s is None else f"{row.up_at_s:.0f}"
        down = "-" if row.down_at_s is None else f"{row.down_at_s:.0f}"
        lines.append(f"| {row.app} | {row.before} | {row.peak} | {row.after} | {up} | {down} |")
    lines += ["", f"![scenario {run.scenario}]({image_dir / f'load_{run.scenario}.png'})", ""]
    if run.batches:
        lines += render_batches(run, image_dir)
    return lines


def render_batches(run: LoadRun, image_dir: Path) -> list[str]:
    """The batch-size table of one scenario and its plot."""
    lines = [
        "Batching, from the batch metrics scraped every second: how many images each model call carried "
        "(`genserve_batch_images` over the count of `genserve_batch_size`; unbatched, a GAN Sample call of the "
        "locustfile carries 4, a VAE Reconstruct 2, a diffusion U-Net step 1), the share of calls with more than "
        "one image (its `le=\"1\"` bucket), and a request's wait from arrival to the start of its batch "
        "(diffusion: to its first step), a mean of bucket midpoints since Ray exports histogram sums that way.",
        "",
        "| service | method | model calls | images | requests | images per call | calls with > 1 image "
        "| mean wait (ms, ≈) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = batch_stats(run.batches)
    for row in rows:
        approx = "" if row.exact else " ≈"  # the histogram's midpoint sum stood in for the images counter
        mean = "-" if math.isnan(row.mean) else f"{row.mean:.2f}{approx}"
        share = "-" if math.isnan(row.batched_share) else f"{100 * row.batched_share:.0f}%"
        wait = "-" if math.isnan(row.mean_wait_ms) else f"{row.mean_wait_ms:.1f}"
        lines.append(f"| {row.service} | {row.method} | {row.calls:.0f} | {row.images:.0f}{approx} | {row.waits:.0f} "
                     f"| {mean} | {share} | {wait} |")
    if not rows:
        lines.append("| (no model call recorded) | | | | | | | |")
    lines += ["", f"![batching, scenario {run.scenario}]({image_dir / f'load_{run.scenario}_batch.png'})", ""]
    return lines


def render_markdown(runs: list[LoadRun], invocation: str, image_dir: Path, models: dict[str, str]) -> str:
    """The page; `models` maps each app to the checkpoint it served (a GENSERVE_<APP>_MODEL or the demo weights)."""
    lines = [
        "# Load test",
        "",
        f"Written by `{invocation}` (tests/load/run.py; the users are in tests/load/locustfile.py). It starts the",
        "local CPU stack (`python -m genserve.services.serve`, deploy/serve_config.local.yaml) on port 9200 unless",
        "given `--target`, runs each scenario headless under `timeout -k`, samples every app's replicas and the",
        "batch-size metrics, and writes this page and its plots. Machine: the 2-core, 24 GiB CPU box the project is",
        "developed on,",
        "shared with other work, so absolute numbers are low; what matters is the shape: no failures, scaling up and",
        "down, fast shedding.",
        "",
        "A shed request never reaches a replica: the proxy answers RESOURCE_EXHAUSTED as soon as the deployment's",
        "queue (`max_queued_requests`) is full. Under overload the proxy, the replicas and locust itself share the two",
        "cores, so a refusal still waits for a core; the check is therefore relative: refusals must come back faster",
        "than the median served request of the same RPC (they did not queue), and nothing may time out or fail.",
        "",
        "Both protocols run side by side: the gRPC users call each application through the gRPC proxy; the `HTTP`",
        "rows are `OpenAIUser`, the OpenAI-compatible API on Serve's HTTP proxy (streamed chat, images), whose 429",
        "answers count as RESOURCE_EXHAUSTED.",
        "",
        "Checkpoints served: " + ", ".join(f"{app} {source}" for app, source in models.items()) + ".",
        "",
    ]
    for run in runs:
        lines += render_run(run, image_dir)
    return "\n".join(lines)
