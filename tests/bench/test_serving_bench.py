"""bench/serving.py's tables: the batching table (N concurrent one-image requests against one N-image request) and
the concurrent chats against gRPC."""

from __future__ import annotations

from bench.serving import batching_table


def test_the_batching_table_shows_both_timings_and_their_ratio():
    table = batching_table([("gan Sample", 32, 0.125, 0.100), ("vae Reconstruct", 32, 0.390, 0.300)])
    lines = table.splitlines()
    assert lines[2] == "| gan Sample | 32 | 125 | 100 | 1.25x |"
    assert lines[3] == "| vae Reconstruct | 32 | 390 | 300 | 1.30x |"


def test_the_concurrency_table_sets_every_row_against_grpc():
    from bench.serving import concurrency_table

    rows = [("gRPC", 200.0, 5.0), ("HTTP", 190.0, 5.3), ("llama.cpp x.gguf, one after another (2 threads)", 80.0, 12.5)]
    lines = concurrency_table(rows, 16, 64, 0.7).splitlines()
    assert lines[0].startswith("| 16 concurrent streamed chats, at most 64 tokens each, temperature 0.7 |")
    assert lines[3] == "| HTTP | 190 | 5.30 | 0.95x |"
    assert lines[4] == "| llama.cpp x.gguf, one after another (2 threads) | 80 | 12.50 | 0.40x |"
