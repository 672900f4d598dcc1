"""bench/serving.py's tables: the batching table (N concurrent one-image requests against one N-image request) and
the paths table (the same chats in-process, over gRPC, over HTTP and on llama-server) with issue 30's goals."""

from __future__ import annotations

from bench.chat_paths import PathResult, Run, goals, table
from bench.serving import batching_table


def test_the_batching_table_shows_both_timings_and_their_ratio():
    table = batching_table([("gan Sample", 32, 0.125, 0.100), ("vae Reconstruct", 32, 0.390, 0.300)])
    lines = table.splitlines()
    assert lines[2] == "| gan Sample | 32 | 125 | 100 | 1.25x |"
    assert lines[3] == "| vae Reconstruct | 32 | 390 | 300 | 1.30x |"


def _path(name: str, serial_rate: float, ttft_s: float, concurrent_rate: float) -> PathResult:
    return PathResult(name, Run(int(serial_rate * 10), 10.0, (ttft_s,) * 8),
                      Run(int(concurrent_rate * 10), 10.0, (ttft_s * 4,) * 16))


def test_the_paths_table_sets_every_row_against_the_engine_in_process():
    rows = [_path("engine", 50.0, 0.080, 120.0), _path("gRPC", 45.0, 0.090, 108.0), _path("llama-server", 90.0, 0.040,
                                                                                          150.0)]
    lines = table(rows, "engine").splitlines()
    assert lines[2] == "| engine | 50.0 | 1.00x | 80 | 120.0 | 1.00x | 320 |"
    assert lines[3] == "| gRPC | 45.0 | 0.90x | 90 | 108.0 | 0.90x | 360 |"
    assert lines[4] == "| llama-server | 90.0 | 1.80x | 40 | 150.0 | 1.25x | 160 |"


def test_the_goals_are_judged_on_the_measured_rows():
    results = {"engine": _path("e", 50.0, 0.080, 120.0), "grpc": _path("g", 45.0, 0.090, 90.0),
               "http": _path("h", 40.0, 0.100, 110.0), "llama": _path("l", 40.0, 0.050, 100.0)}
    assert goals(results) == [
        "PASS: gRPC serial tok/s / in-process 0.90x (>= 0.85x)",
        "MISS: gRPC concurrent tok/s / in-process 0.75x (>= 0.85x)",
        "MISS: HTTP serial tok/s / in-process 0.80x (>= 0.85x)",
        "PASS: HTTP concurrent tok/s / in-process 0.92x (>= 0.85x)",
        "PASS: HTTP serial tok/s / llama-server 1.00x (>= 1.0x)",
        "MISS: HTTP serial TTFT p50 / llama-server 2.00x (<= 1.5x)",
        "PASS: HTTP concurrent tok/s / llama-server 1.10x (>= 1.1x)",
    ]
    del results["llama"]
    assert len(goals(results)) == 4  # no llama-server row: its goals are not judged
