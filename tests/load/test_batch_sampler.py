"""tests/load/run.py's BatchSampler: scrapes a Prometheus endpoint once per period into BatchSamples."""

from __future__ import annotations

import http.server
import threading
import time

from tests.load.run import BatchSampler

PAGE = (
    'ray_genserve_batch_size_bucket{le="1.0",method="generate",replica="r1",service="gan"} 0.0\n'
    'ray_genserve_batch_size_bucket{le="+Inf",method="generate",replica="r1",service="gan"} 2.0\n'
    'ray_genserve_batch_size_sum{method="generate",replica="r1",service="gan"} 12.0\n'
    'ray_genserve_batch_size_count{method="generate",replica="r1",service="gan"} 2.0\n'
)


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the handler's name)
        body = PAGE.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args) -> None:
        pass


def test_batch_sampler_scrapes_every_period_and_counts_lost_scrapes() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sampler = BatchSampler(f"http://127.0.0.1:{server.server_port}/metrics", period_s=0.1)
        sampler.start()
        time.sleep(0.45)
        sampler.stop()
    finally:
        server.shutdown()
        server.server_close()
    assert len(sampler.samples) >= 2 and sampler.errors == 0
    sample = sampler.samples[0]
    assert (sample.service, sample.method, sample.replica, sample.sum, sample.count) == ("gan", "generate", "r1",
                                                                                         12.0, 2.0)
    assert sample.buckets == {"1": 0.0, "+Inf": 2.0}

    lost = BatchSampler(f"http://127.0.0.1:{server.server_port}/metrics", period_s=0.1)  # the server is down now
    lost.start()
    time.sleep(0.25)
    lost.stop()
    assert lost.errors >= 1 and lost.samples == []
