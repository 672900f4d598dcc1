"""tests/load/report.py: the statistics and verdicts that docs/load.md is written from."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("load_report", Path(__file__).with_name("report.py"))
report = importlib.util.module_from_spec(_spec)
sys.modules["load_report"] = report  # dataclasses resolve their module by name
_spec.loader.exec_module(report)

T0 = 1_000.0


def _event(t: float, name: str, ms: float, code: str = "OK"):
    return report.RequestEvent(t=T0 + t, name=name, ms=ms, code=code)


def _samples(app: str, counts: list[int], status: str = "RUNNING", start: float = -2.0):
    return [report.ReplicaSample(T0 + start + i, app, status, {"RUNNING": n}) for i, n in enumerate(counts)]


def _run(scenario: str, events, samples, **kwargs):
    return report.LoadRun(
        scenario=scenario, command="locust", env={}, users=4, run_time_s=10, started=T0, load_end=T0 + 10,
        events=events, replicas=samples, **kwargs,
    )


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]
    assert report.percentile(values, 50) == 50.0
    assert report.percentile(values, 95) == 95.0
    assert report.percentile(values, 99) == 99.0
    assert report.percentile([7.0], 99) == 7.0
    assert math.isnan(report.percentile([], 50))


def test_rpc_stats_keep_shed_answers_apart_from_served_and_failed() -> None:
    events = [_event(1, "Vae/Reconstruct", ms) for ms in (10, 20, 30, 40)]
    events.append(_event(2, "Vae/Reconstruct [shed]", 3, "RESOURCE_EXHAUSTED"))
    events.append(_event(3, "Vae/Reconstruct", 5, "INTERNAL"))
    (row,) = report.rpc_stats(events, duration_s=2.0)
    assert (row.name, row.ok, row.failed, row.shed) == ("Vae/Reconstruct", 4, 1, 1)
    assert row.rps == pytest.approx(2.0)
    assert (row.p50, row.p99, row.shed_p99) == (20, 40, 3)


def test_failures_by_code_group_rpcs_under_their_base_name() -> None:
    events = [_event(1, "Diffusion/Generate [shed]", 2, "RESOURCE_EXHAUSTED"), _event(1, "Diffusion/Generate", 9)]
    events.append(_event(2, "ImageGan/Sample", 4, "DEADLINE_EXCEEDED"))
    table = report.failures_by_code(events)
    assert table == {"RESOURCE_EXHAUSTED": {"Diffusion/Generate": 1}, "DEADLINE_EXCEEDED": {"ImageGan/Sample": 1}}


def test_scaling_finds_the_rise_under_load_and_the_fall_after_it() -> None:
    samples = _samples("diffusion", [1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1]) + _samples("gan", [1] * 16)
    rows = {row.app: row for row in report.scaling(samples, T0, T0 + 10)}
    diffusion = rows["diffusion"]
    assert (diffusion.before, diffusion.peak, diffusion.after) == (1, 2, 1)
    assert diffusion.up_at_s == pytest.approx(2.0) and diffusion.down_at_s == pytest.approx(12.0)
    assert diffusion.scaled_up_and_down
    assert rows["gan"].up_at_s is None and not rows["gan"].scaled_up_and_down


def test_scaling_up_without_coming_back_down_does_not_count() -> None:
    (row,) = report.scaling(_samples("text", [1, 1, 1, 2, 2, 2]), T0, T0 + 10)
    assert row.peak == 2 and row.down_at_s is None and not row.scaled_up_and_down


def test_mixed_passes_with_only_deliberate_shedding_and_scaling() -> None:
    events = [_event(1, "TextGeneration/Generate", 50)]
    events.append(_event(2, "TextGeneration/Generate [shed]", 2, "RESOURCE_EXHAUSTED"))
    samples = _samples("text", [1, 1, 1, 2, 2, 1])
    ok, reasons = _run("mixed", events, samples, controller_logs_watched=1).verdict()
    assert ok, reasons


@pytest.mark.parametrize(
    "change",
    ["unavailable", "no_scaling", "unhealthy", "controller_crash"],
)
def test_mixed_fails_for_each_real_defect(change: str) -> None:
    events = [_event(1, "TextGeneration/Generate", 50)]
    samples = _samples("text", [1, 1, 1, 2, 2, 1])
    kwargs = {}
    if change == "unavailable":
        events.append(_event(2, "ImageGan/Sample", 1, "UNAVAILABLE"))
    elif change == "no_scaling":
        samples = _samples("text", [1] * 6)
    elif change == "unhealthy":
        samples += _samples("gan", [1, 1, 0], status="UNHEALTHY")
    else:
        kwargs["replica_failures"] = ["Actor for Replica(id='x') crashed, marking it unhealthy immediately."]
    ok, reasons = _run("mixed", events, samples, **kwargs).verdict()
    assert not ok, reasons


def test_overload_needs_shed_answers_faster_than_served_ones() -> None:
    served = [_event(1, "Diffusion/Generate", ms) for ms in (800, 900, 1000)]
    fast = served + [_event(2, "Diffusion/Generate [shed]", 15, "RESOURCE_EXHAUSTED") for _ in range(5)]
    queued = served + [_event(2, "Diffusion/Generate [shed]", 950, "RESOURCE_EXHAUSTED") for _ in range(5)]
    samples = _samples("diffusion", [1, 2, 2])
    assert _run("overload", fast, samples).verdict()[0]
    assert not _run("overload", queued, samples).verdict()[0], "a refusal that waited like a served call"
    assert not _run("overload", served, samples).verdict()[0], "no shedding at all is not an overload"
    timeouts = fast + [_event(3, "Diffusion/Generate", 60_000, "DEADLINE_EXCEEDED")]
    assert not _run("overload", timeouts, samples).verdict()[0]


def test_timeline_bins_served_shed_and_failed_per_second() -> None:
    events = [_event(0.5, "A", 10), _event(0.7, "A", 30), _event(1.5, "A [shed]", 1, "RESOURCE_EXHAUSTED")]
    events += [_event(1.6, "A", 1, "INTERNAL"), _event(0.6, "A [first]", 2)]
    series = report.timeline(_run("mixed", events, _samples("a", [1, 1])), bin_s=1.0)
    assert series["served"][:2] == [2.0, 0.0]
    assert series["shed"][:2] == [0.0, 1.0] and series["failed"][:2] == [0.0, 1.0]
    assert series["p50"][0] == 10 and series["p95"][0] == 30 and math.isnan(series["p50"][1])
