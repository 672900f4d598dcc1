"""tests/load/soak_report.py: RSS growth per replica between the post-warm-up window and the last one, the verdict,
the page and the plot, on synthetic samples (no stack)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.load.report import RequestEvent
from tests.load.soak import ports, warm_up_seconds
from tests.load.soak_report import RssSample, SoakRun, growth, render_markdown, verdict, write_plot

T0 = 10_000.0
END = T0 + 600


def series(app: str, pid: int, kib: callable, start: float = T0, end: float = END) -> list[RssSample]:
    """A sample every 5 s from `start` to `end`, RSS kib(t since T0)."""
    return [RssSample(t, app, pid, int(kib(t - T0))) for t in [start + 5 * i for i in range(int((end - start) // 5))]]


def soak(samples: list[RssSample], failures: int = 0) -> SoakRun:
    events = [RequestEvent(T0 + i, "ImageGan/Sample", 12.0, "OK") for i in range(50)]
    events += [RequestEvent(T0 + i, "Diffusion/Generate [shed]", 3.0, "RESOURCE_EXHAUSTED") for i in range(failures)]
    events.append(RequestEvent(T0 + 1, "TextGeneration/GenerateStream [first]", 40.0, "OK"))
    return SoakRun("make soak", 600, 120, T0, END, samples, events)


def test_growth_compares_medians_of_the_windows_after_warm_up_and_at_the_end() -> None:
    # 100 MiB through the warm-up, then flat at 200 MiB with one spike at the end window's edge.
    flat = series("gan", 1, lambda t: 100 * 1024 if t < 120 else (300 * 1024 if t == 595 else 200 * 1024))
    leaky = series("text", 2, lambda t: 400 * 1024 + 100 * t)  # +100 KiB/s: ~11% over the measured span
    rows = {r.pid: r for r in growth(flat + leaky, T0, warm_end=T0 + 120, end=END)}
    assert rows[1].judged and rows[1].warm_kib == rows[1].end_kib == 200 * 1024 and rows[1].growth_pct == 0
    assert rows[2].growth_pct == pytest.approx(100 * (100 * 582.5 - 100 * 132.5) / (400 * 1024 + 100 * 132.5),
                                               rel=0.02)
    assert rows[2].growth_pct > 5


def test_a_flat_run_without_failures_passes_and_a_leak_or_a_failure_fails() -> None:
    flat = series("gan", 1, lambda t: 200 * 1024) + series("vae", 3, lambda t: 300 * 1024 + (t % 20))
    ok, reasons = verdict(soak(flat))
    assert ok, reasons
    assert reasons[0] == "50 requests, 0 failures"
    assert not verdict(soak(flat, failures=2))[0]
    assert not verdict(soak(flat + series("text", 2, lambda t: 400 * 1024 + 100 * t)))[0]


def test_a_replica_that_came_during_the_run_is_listed_but_not_judged() -> None:
    late = series("diffusion", 9, lambda t: 100 * 1024 + 1000 * (t - 300), start=T0 + 300)
    rows = growth(series("gan", 1, lambda t: 200 * 1024) + late, T0, warm_end=T0 + 120, end=END)
    assert [(r.pid, r.judged, r.first_s) for r in rows] == [(1, True, 0), (9, False, 300)]
    ok, reasons = verdict(soak(series("gan", 1, lambda t: 200 * 1024) + late))
    assert ok and "1 replicas came or went during the run (autoscaling), not judged" in reasons


def test_no_judged_replica_is_no_pass() -> None:
    assert not verdict(soak([]))[0]


def test_the_page_and_the_plot(tmp_path: Path) -> None:
    run = soak(series("gan", 1, lambda t: 200 * 1024) + series("text", 2, lambda t: 400 * 1024), failures=1)
    page = render_markdown(run, Path("img/soak_rss.png"), "2026-12-02 12:00 UTC")
    assert "## Result: FAIL" in page
    assert "| gan | 1 | 200.0 | 200.0 | +0.0% | yes |" in page
    assert "| Diffusion/Generate | 0 | RESOURCE_EXHAUSTED 1 |" in page
    assert "![replica RSS over the soak](img/soak_rss.png)" in page
    write_plot(run, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_soak_stack_has_its_own_port_block_and_warm_up() -> None:
    assert ports(9300) == {"grpc": 9300, "health": 9301, "http": 8300, "metrics": 8302}
    assert warm_up_seconds(600) == 120 and warm_up_seconds(60) == 12
