"""Turns a soak run (RSS samples of every replica + locust's request events) into the growth table, the verdict, a
plot and docs/soak.md.

Growth compares medians over a window, not single samples (RSS moves by a few MiB as the allocator takes and
returns pages): the window that starts when the warm-up ends, against the last window of the run. Only replicas
alive across both windows are judged; one that the autoscaler added or removed on the way is listed apart.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tests.load.report import FIRST_SUFFIX, RequestEvent, failures_by_code

MAX_GROWTH_PCT = 5.0
WINDOW_S = 30.0


@dataclass(frozen=True)
class RssSample:
    t: float
    app: str
    pid: int
    rss_kib: int


@dataclass(frozen=True)
class ReplicaGrowth:
    app: str
    pid: int
    first_s: float
    last_s: float
    warm_kib: float
    end_kib: float
    judged: bool

    @property
    def growth_pct(self) -> float:
        return 100.0 * (self.end_kib - self.warm_kib) / self.warm_kib if self.warm_kib else math.nan


@dataclass
class SoakRun:
    command: str
    run_time_s: float
    warm_up_s: float
    started: float
    load_end: float
    samples: list[RssSample]
    events: list[RequestEvent]

    def growth(self) -> list[ReplicaGrowth]:
        return growth(self.samples, self.started, self.started + self.warm_up_s, self.load_end)

    def requests(self) -> list[RequestEvent]:
        """One event per finished call (a stream's first-message events are not calls)."""
        return [e for e in self.events if not e.name.endswith(FIRST_SUFFIX)]

    def failures(self) -> int:
        return sum(1 for e in self.requests() if e.code != "OK")


def _median_kib(samples: list[RssSample]) -> float:
    return statistics.median(s.rss_kib for s in samples) if samples else math.nan


def growth(samples: list[RssSample], started: float, warm_end: float, end: float,
           window_s: float = WINDOW_S) -> list[ReplicaGrowth]:
    """Per replica process: median RSS over [warm_end, warm_end + window) against [end - window, end]; a replica
    without samples in both windows (it came or went during the run) is reported on its own first and last
    windows and not judged. Times in the rows are seconds since `started`."""
    by_pid: dict[int, list[RssSample]] = defaultdict(list)
    for sample in samples:
        by_pid[sample.pid].append(sample)
    rows = []
    for pid, series in by_pid.items():
        series.sort(key=lambda s: s.t)
        warm = [s for s in series if warm_end <= s.t < warm_end + window_s]
        final = [s for s in series if end - window_s <= s.t <= end]
        judged = bool(warm and final)
        if not judged:
            warm = [s for s in series if s.t < series[0].t + window_s]
            final = [s for s in series if s.t > series[-1].t - window_s]
        rows.append(ReplicaGrowth(series[0].app, pid, series[0].t - started, series[-1].t - started,
                                  _median_kib(warm), _median_kib(final), judged))
    return sorted(rows, key=lambda r: (not r.judged, r.app, r.pid))


def verdict(run: SoakRun) -> tuple[bool, list[str]]:
    rows = run.growth()
    judged = [r for r in rows if r.judged]
    worst = max(judged, key=lambda r: r.growth_pct, default=None)
    failed = run.failures()
    reasons = [
        f"{len(run.requests())} requests, {failed} failures",
        f"{len(judged)} replicas alive from the end of the warm-up to the end; largest RSS growth "
        + (f"{worst.growth_pct:+.1f}% ({worst.app}, pid {worst.pid})" if worst else "-")
        + f" (limit {MAX_GROWTH_PCT:.0f}%)",
    ]
    others = [r for r in rows if not r.judged]
    if others:
        reasons.append(f"{len(others)} replicas came or went during the run (autoscaling), not judged")
    ok = bool(judged) and failed == 0 and all(r.growth_pct < MAX_GROWTH_PCT for r in judged)
    return ok, reasons


def write_plot(run: SoakRun, path: Path) -> None:
    """RSS of every replica over time (warm-up and the two compared windows shaded), and requests per 10 s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    warm_end = run.warm_up_s
    fig, (ax_rss, ax_req) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(3, 1))
    for row in run.growth():
        series = sorted((s.t - run.started, s.rss_kib / 1024) for s in run.samples if s.pid == row.pid)
        ax_rss.plot([p[0] for p in series], [p[1] for p in series], label=f"{row.app} (pid {row.pid})")
    ax_rss.set_ylabel("RSS (MiB)")
    ax_rss.set_yscale("log")
    bins: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for event in run.requests():
        bins[int((event.t - run.started) // 10)][event.code != "OK"] += 1
    times = sorted(bins)
    ax_req.bar([10 * b + 5 for b in times], [bins[b][0] / 10 for b in times], width=9, label="served/s")
    ax_req.bar([10 * b + 5 for b in times], [bins[b][1] / 10 for b in times], width=9, label="failed/s",
               bottom=[bins[b][0] / 10 for b in times], color="tab:red")
    ax_req.set_ylabel("requests/s")
    ax_req.set_xlabel("seconds since the load started")
    end = run.load_end - run.started
    for ax in (ax_rss, ax_req):
        ax.axvspan(0, warm_end, color="0.9", zorder=0)
        ax.axvspan(warm_end, warm_end + WINDOW_S, color="tab:green", alpha=0.15, zorder=0)
        ax.axvspan(end - WINDOW_S, end, color="tab:green", alpha=0.15, zorder=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=7)
    fig.suptitle("genserve soak: replica RSS (grey: warm-up; green: the windows compared)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render_markdown(run: SoakRun, image: Path, date: str) -> str:
    ok, reasons = verdict(run)
    lines = [
        "# Soak test",
        "",
        f"Written by `{run.command}` on {date} (tests/load/soak.py). It starts a fresh local stack on 127.0.0.1",
        "(`python -m genserve.services.serve`, deploy/serve_config.local.yaml, the default text model), runs the",
        "locustfile's mixed gRPC and HTTP (OpenAI API) users for the set time, and reads every Serve replica's RSS",
        "from /proc every few seconds. Growth compares the median RSS over the first "
        f"{WINDOW_S:.0f} s after the {run.warm_up_s:.0f} s warm-up with the median over the last {WINDOW_S:.0f} s.",
        "The machine is the shared 2-core development box; CPU contention changes the request rate, not what memory",
        "does per request.",
        "",
        f"## Result: {'PASS' if ok else 'FAIL'}",
        "",
        *[f"- {reason}" for reason in reasons],
        "",
        "| app | pid | RSS after warm-up (MiB) | RSS at the end (MiB) | growth | judged |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in run.growth():
        judged = "yes" if row.judged else f"no: seen {row.first_s:.0f}..{row.last_s:.0f} s after the start"
        lines.append(f"| {row.app} | {row.pid} | {row.warm_kib / 1024:.1f} | {row.end_kib / 1024:.1f} "
                     f"| {row.growth_pct:+.1f}% | {judged} |")
    lines += ["", "Requests by RPC and answer (`[shed]`: RESOURCE_EXHAUSTED, counted as failures here):", ""]
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for event in run.requests():
        counts[event.name.removesuffix(" [shed]")][event.code] += 1
    lines += ["| RPC | OK | other |", "|---|---:|---|"]
    for name, codes in sorted(counts.items()):
        other = ", ".join(f"{c} {n}" for c, n in sorted(codes.items()) if c != "OK") or "-"
        lines.append(f"| {name} | {codes.get('OK', 0)} | {other} |")
    failures = failures_by_code(run.requests())
    lines += ["", f"Failures by code: {dict((c, sum(n.values())) for c, n in failures.items()) or 'none'}.", "",
              f"![replica RSS over the soak]({image})", ""]
    return "\n".join(lines)
