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


def _exposition(series: dict[tuple[str, str, str], tuple]) -> str:
    """Prometheus text as Ray writes it: for each (service, method, replica) the batch-size histogram (sum, count,
    cumulative buckets "1.0" ... "+Inf"), the wait histogram's sum and count, and the images counter (left out
    when None)."""
    lines = ["# HELP ray_genserve_batch_size Images per model call of a batching app.",
             "# TYPE ray_genserve_batch_size histogram",
             'ray_genserve_requests_total{Component="core_worker",method="Sample",service="gan"} 99.0']
    for (service, method, replica), (total, count, buckets, wait_sum, wait_count, images) in series.items():
        labels = (f'Component="core_worker",SessionName="session_x",application="{service}",method="{method}",'
                  f'otel_scope_schema_url="",replica="{replica}",service="{service}"')
        for le, n in buckets.items():
            lines.append(f'ray_genserve_batch_size_bucket{{{labels},le="{le}"}} {n}')
        lines.append(f"ray_genserve_batch_size_count{{{labels}}} {count}")
        lines.append(f"ray_genserve_batch_size_sum{{{labels}}} {total}")
        if images is not None:
            lines.append(f"ray_genserve_batch_images_total{{{labels}}} {images}")
        lines.append(f"ray_genserve_batch_wait_seconds_sum{{{labels}}} {wait_sum}")
        lines.append(f"ray_genserve_batch_wait_seconds_count{{{labels}}} {wait_count}")
    return "\n".join(lines) + "\n"


def _buckets(**upto: float) -> dict[str, float]:
    """Cumulative buckets: `upto` gives the count at "1.0", "2.0", "4.0", "8.0"; "+Inf" repeats the last."""
    values = [upto.get(f"le{bound}", 0.0) for bound in (1, 2, 4, 8)]
    return {"1.0": values[0], "2.0": values[1], "4.0": values[2], "8.0": values[3], "+Inf": values[3]}


# Two scrapes 3 s apart; `_sum` is what Ray exports, bucket midpoints (0.5, 1.5, 3, 6 for 1, 2, 3-4, 5-8 images),
# the images counter is exact. GAN replica r1: 3 calls of 4 images before, then one of 4 and one of 8 (3 requests,
# 30 ms of waits); a second GAN replica r2 appears with one call of 4. Diffusion: 10 one-image steps before, then
# 20 steps, 10 of one image and 10 of three. VAE r9 is there before and gone after (a replica stopped).
SCRAPE_0 = {
    ("gan", "generate", "r1"): (9.0, 3.0, _buckets(le4=3, le8=3), 0.03, 3.0, 12.0),
    ("diffusion", "Generate", "d1"): (5.0, 10.0, _buckets(le1=10, le2=10, le4=10, le8=10), 0.5, 10.0, 10.0),
    ("vae", "reconstruct", "r9"): (4.5, 3.0, _buckets(le2=3, le4=3, le8=3), 0.01, 3.0, 6.0),
}
SCRAPE_1 = {
    ("gan", "generate", "r1"): (18.0, 5.0, _buckets(le4=4, le8=5), 0.06, 6.0, 24.0),
    ("gan", "generate", "r2"): (3.0, 1.0, _buckets(le4=1, le8=1), 0.002, 1.0, 4.0),
    ("diffusion", "Generate", "d1"): (40.0, 30.0, _buckets(le1=20, le2=20, le4=30, le8=30), 0.9, 14.0, 50.0),
}


def _two_scrapes(scrapes=(SCRAPE_0, SCRAPE_1)):
    return [sample for i, scrape in enumerate(scrapes)
            for sample in report.parse_batch_metrics(_exposition(scrape), T0 + 3 * i)]


def _without_counter(scrape: dict) -> dict:
    return {key: (*values[:5], None) for key, values in scrape.items()}


def test_parse_batch_metrics_reads_one_sample_per_replica_service_and_method() -> None:
    samples = report.parse_batch_metrics(_exposition(SCRAPE_1), T0 + 3)
    assert [s.key for s in samples] == [("diffusion", "Generate", "d1"), ("gan", "generate", "r1"),
                                        ("gan", "generate", "r2")]
    gan = samples[1]
    assert (gan.t, gan.sum, gan.count, gan.wait_sum, gan.wait_count, gan.images) == (T0 + 3, 18.0, 5.0, 0.06, 6.0,
                                                                                     24.0)
    assert gan.buckets == {"1": 0.0, "2": 0.0, "4": 4.0, "8": 5.0, "+Inf": 5.0}
    assert report.parse_batch_metrics(_exposition(_without_counter(SCRAPE_1)), T0)[1].images is None
    assert report.parse_batch_metrics("# nothing batched yet\nray_genserve_images_total{service=\"gan\"} 4\n", T0) == []


def test_batch_samples_survive_their_json_lines(tmp_path: Path) -> None:
    import dataclasses
    import json

    samples = _two_scrapes()
    path = tmp_path / "batches.jsonl"
    path.write_text("".join(json.dumps(dataclasses.asdict(s)) + "\n" for s in samples))
    assert report.read_batches(path) == samples


def test_batch_deltas_count_from_the_first_scrape_and_new_replicas_from_zero() -> None:
    deltas = report.batch_deltas(_two_scrapes())
    assert {(d.stats.service, d.stats.method, d.stats.calls) for d in deltas} == {
        ("gan", "generate", 2.0), ("gan", "generate", 1.0), ("diffusion", "Generate", 20.0)}  # not the gone vae
    stats = {row.service: row for row in report.batch_stats(_two_scrapes())}
    gan, diffusion = stats["gan"], stats["diffusion"]
    # GAN: r1 gained 2 calls / 12 images, the new r2 1 call / 4 images: 16 images in 3 calls.
    assert (gan.calls, gan.images, gan.single, gan.exact) == (3.0, 16.0, 0.0, True)
    assert gan.mean == pytest.approx(16 / 3) and gan.batched_share == 1.0
    assert gan.waits == 4.0 and gan.mean_wait_ms == pytest.approx(8.0)  # (0.03 + 0.002) s over 4 requests
    # Diffusion: 20 steps, 40 images, 10 of them single-image.
    assert (diffusion.calls, diffusion.images, diffusion.single) == (20.0, 40.0, 10.0)
    assert diffusion.mean == pytest.approx(2.0) and diffusion.batched_share == pytest.approx(0.5)
    assert diffusion.mean_wait_ms == pytest.approx(100.0)  # 0.4 s over 4 requests
    assert "vae" not in stats


def test_batch_stats_fall_back_to_the_midpoint_sum_without_the_images_counter() -> None:
    stats = {row.service: row for row in report.batch_stats(
        _two_scrapes((_without_counter(SCRAPE_0), _without_counter(SCRAPE_1))))}
    assert (stats["gan"].images, stats["gan"].exact) == (12.0, False)  # 3 calls as Ray's midpoint 3, not 16
    assert (stats["diffusion"].images, stats["diffusion"].exact) == (35.0, False)


def test_batch_deltas_count_a_restarted_replica_from_zero() -> None:
    key = ("gan", "generate", "r1")
    (row,) = report.batch_stats(_two_scrapes(({key: SCRAPE_1[key]}, {key: SCRAPE_0[key]})))
    assert (row.calls, row.images) == (3.0, 12.0)


def test_batch_timeline_gives_images_per_call_per_bin() -> None:
    samples = _two_scrapes()
    samples += report.parse_batch_metrics(_exposition({
        ("gan", "generate", "r1"): (24.0, 7.0, _buckets(le4=6, le8=7), 0.07, 8.0, 32.0),
        ("gan", "generate", "r2"): SCRAPE_1[("gan", "generate", "r2")],
        ("diffusion", "Generate", "d1"): SCRAPE_1[("diffusion", "Generate", "d1")],
    }), T0 + 7)
    series = report.batch_timeline(samples, T0, T0 + 9, bin_s=3.0)
    assert series["t"] == [1.5, 4.5, 7.5]
    # The scrape at 3 s closes the first bin; the one at 7 s the third (nothing closed in the second).
    assert series["mean:gan generate"][0] == pytest.approx(16 / 3) and math.isnan(series["mean:gan generate"][1])
    assert series["mean:gan generate"][2] == pytest.approx(4.0)  # two more calls of 4
    assert series["calls:gan generate"] == pytest.approx([1.0, 0.0, 2 / 3])
    diffusion = series["mean:diffusion Generate"]
    assert diffusion[0] == pytest.approx(2.0) and math.isnan(diffusion[2])


def test_render_batches_tabulates_each_service_and_points_at_its_plot() -> None:
    run = _run("mixed", [_event(1, "ImageGan/Sample", 10)], _samples("gan", [1, 1]), batches=_two_scrapes())
    lines = report.render_run(run, Path("img"))
    assert "| gan | generate | 3 | 16 | 4 | 5.33 | 100% | 8.0 |" in lines
    assert "| diffusion | Generate | 20 | 40 | 4 | 2.00 | 50% | 100.0 |" in lines
    assert "![batching, scenario mixed](img/load_mixed_batch.png)" in lines
    approx = _run("mixed", [], _samples("gan", [1]), batches=_two_scrapes((_without_counter(SCRAPE_0),
                                                                            _without_counter(SCRAPE_1))))
    assert "| gan | generate | 3 | 12 ≈ | 4 | 4.00 ≈ | 100% | 8.0 |" in report.render_run(approx, Path("img"))
    assert not any("batch" in line for line in report.render_run(_run("mixed", [], _samples("gan", [1])), Path("img")))


def test_write_batch_plot_writes_a_png(tmp_path: Path) -> None:
    import matplotlib  # noqa: F401  (the load extra; the report draws with it)
    run = _run("mixed", [], _samples("gan", [1, 1]), batches=_two_scrapes())
    report.write_batch_plot(run, tmp_path / "img" / "load_mixed_batch.png")
    assert (tmp_path / "img" / "load_mixed_batch.png").read_bytes()[:4] == b"\x89PNG"
