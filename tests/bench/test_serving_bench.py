"""bench/serving.py's batching table: N concurrent one-image requests against one N-image request, with the ratio."""

from __future__ import annotations

from bench.serving import batching_table


def test_the_batching_table_shows_both_timings_and_their_ratio():
    table = batching_table([("gan Sample", 32, 0.125, 0.100), ("vae Reconstruct", 32, 0.390, 0.300)])
    lines = table.splitlines()
    assert lines[2] == "| gan Sample | 32 | 125 | 100 | 1.25x |"
    assert lines[3] == "| vae Reconstruct | 32 | 390 | 300 | 1.30x |"
