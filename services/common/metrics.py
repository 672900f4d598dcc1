"""Prometheus metrics of the four apps, one naming scheme: `genserve_*` (Ray exports them with a `ray_` prefix).

Every metric carries the `service` label (text | gan | vae | diffusion); Ray Serve adds `application`,
`deployment` and `replica`. The handler wrapper (services/common/rpc.py) records the request metrics; the apps
record their own model metrics through `ServiceMetrics`.

- genserve_requests (counter; service, method, code): finished RPCs by gRPC status code
- genserve_request_latency_seconds (histogram; service, method): handler entry to the last byte
- genserve_ongoing_requests (gauge; service): requests inside this replica (its queue depth)
- genserve_text_time_to_first_token_seconds (histogram; service, method): handler entry to the first token
- genserve_text_generated_tokens (counter; service): generated tokens (tokens/s via rate())
- genserve_text_kv_free_blocks (gauge; service): free blocks of the paged KV cache
- genserve_text_prefix_cache_hit_tokens (counter; service): prompt tokens whose K/V came from the prefix cache
- genserve_text_prefix_cache_queried_tokens (counter; service): prompt tokens admitted (the hit rate's denominator)
- genserve_text_preemptions (counter; service): sequences preempted (their blocks freed, recomputed later) because
  the KV cache ran out
- genserve_diffusion_steps (counter; service): denoising steps run (steps/s via rate())
- genserve_diffusion_step_seconds (histogram; service): duration of one denoising step
- genserve_images (counter; service, method): images produced (images/s via rate())
- genserve_batch_size (histogram; service, method): images per model call of a batching app (gan, vae; diffusion:
  per U-Net call of its step loop, services/diffusion/step_batcher.py)
- genserve_batch_images (counter; service, method): the images of those model calls, exactly: Ray exports a
  histogram's `_sum` rebuilt from bucket midpoints, so mean images per call is this over genserve_batch_size's count
- genserve_batch_wait_seconds (histogram; service, method): a request's time from arrival to the start of its batch
- genserve_cpu_kernels_available (gauge; service): 1 when the C kernels are in use, 0 when the replica fell back to
  torch ops (the replica's log says why)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ray.serve import metrics

LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
STEP_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
BATCH_SIZE_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
WAIT_BOUNDARIES = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]


@dataclass(frozen=True)
class _Registry:
    requests: metrics.Counter
    latency: metrics.Histogram
    ongoing: metrics.Gauge
    ttft: metrics.Histogram
    tokens: metrics.Counter
    kv_free: metrics.Gauge
    prefix_hits: metrics.Counter
    prefix_queries: metrics.Counter
    preemptions: metrics.Counter
    steps: metrics.Counter
    step_seconds: metrics.Histogram
    images: metrics.Counter
    batch_size: metrics.Histogram
    batch_images: metrics.Counter
    batch_wait: metrics.Histogram
    cpu_kernels: metrics.Gauge


@functools.cache
def _registry() -> _Registry:
    """Created on first use inside a replica (never at import), once per process."""
    return _Registry(
        requests=metrics.Counter(
            "genserve_requests", description="Finished RPCs by gRPC status code.",
            tag_keys=("service", "method", "code"),
        ),
        latency=metrics.Histogram(
            "genserve_request_latency_seconds", description="RPC latency inside the replica.",
            boundaries=LATENCY_BOUNDARIES, tag_keys=("service", "method"),
        ),
        ongoing=metrics.Gauge(
            "genserve_ongoing_requests", description="Requests being handled by this replica.", tag_keys=("service",)
        ),
        ttft=metrics.Histogram(
            "genserve_text_time_to_first_token_seconds", description="Time to the first generated token.",
            boundaries=LATENCY_BOUNDARIES, tag_keys=("service", "method"),
        ),
        tokens=metrics.Counter(
            "genserve_text_generated_tokens", description="Generated tokens.", tag_keys=("service",)
        ),
        kv_free=metrics.Gauge(
            "genserve_text_kv_free_blocks", description="Free blocks of the paged KV cache.", tag_keys=("service",)
        ),
        prefix_hits=metrics.Counter(
            "genserve_text_prefix_cache_hit_tokens", description="Prompt tokens whose K/V came from the prefix cache.",
            tag_keys=("service",),
        ),
        prefix_queries=metrics.Counter(
            "genserve_text_prefix_cache_queried_tokens", description="Prompt tokens admitted to the engine.",
            tag_keys=("service",),
        ),
        preemptions=metrics.Counter(
            "genserve_text_preemptions", description="Sequences preempted because the KV cache ran out.",
            tag_keys=("service",),
        ),
        steps=metrics.Counter(
            "genserve_diffusion_steps", description="Denoising steps run.", tag_keys=("service",)
        ),
        step_seconds=metrics.Histogram(
            "genserve_diffusion_step_seconds", description="Duration of one denoising step.",
            boundaries=STEP_BOUNDARIES, tag_keys=("service",),
        ),
        images=metrics.Counter(
            "genserve_images", description="Images produced.", tag_keys=("service", "method")
        ),
        batch_size=metrics.Histogram(
            "genserve_batch_size", description="Images per model call of a batching app.",
            boundaries=BATCH_SIZE_BOUNDARIES, tag_keys=("service", "method"),
        ),
        batch_images=metrics.Counter(
            "genserve_batch_images", description="Images through the model calls of a batching app.",
            tag_keys=("service", "method"),
        ),
        batch_wait=metrics.Histogram(
            "genserve_batch_wait_seconds", description="Time from a request's arrival to the start of its batch.",
            boundaries=WAIT_BOUNDARIES, tag_keys=("service", "method"),
        ),
        cpu_kernels=metrics.Gauge(
            "genserve_cpu_kernels_available", description="1 when the C kernels are in use, 0 on the torch fallback.",
            tag_keys=("service",),
        ),
    )


class ServiceMetrics:
    """The metrics of one service inside one replica."""

    def __init__(self, service: str):
        self.service = service
        self._ongoing = 0
        self._reported: dict[tuple[str, str], int] = {}  # (engine, total) -> what its counter has had

    def request_started(self) -> None:
        self._ongoing += 1
        _registry().ongoing.set(self._ongoing, tags={"service": self.service})

    def request_finished(self, method: str, code: str, seconds: float) -> None:
        self._ongoing -= 1
        reg = _registry()
        reg.ongoing.set(self._ongoing, tags={"service": self.service})
        reg.requests.inc(1, tags={"service": self.service, "method": method, "code": code})
        reg.latency.observe(seconds, tags={"service": self.service, "method": method})

    @property
    def ongoing(self) -> int:
        return self._ongoing

    def first_token(self, method: str, seconds: float) -> None:
        _registry().ttft.observe(seconds, tags={"service": self.service, "method": method})

    def tokens(self, n: int) -> None:
        if n:
            _registry().tokens.inc(n, tags={"service": self.service})

    def kv_free_blocks(self, n: int) -> None:
        _registry().kv_free.set(n, tags={"service": self.service})

    def engine_totals(self, hit_tokens: int, queried_tokens: int, preemptions: int, engine: str = "") -> None:
        """Bring the counters (prefix-cache tokens, preemptions) up to the running totals since start-up of the
        replica's engine `engine` (a text app serves one per base model; the counters sum them)."""
        reg, tags = _registry(), {"service": self.service}
        for name, counter, total in (("hit_tokens", reg.prefix_hits, hit_tokens),
                                     ("queried_tokens", reg.prefix_queries, queried_tokens),
                                     ("preemptions", reg.preemptions, preemptions)):
            reported = self._reported.get((engine, name), 0)
            if total > reported:
                counter.inc(total - reported, tags=tags)
                self._reported[engine, name] = total

    def denoising_step(self, seconds: float) -> None:
        reg = _registry()
        reg.steps.inc(1, tags={"service": self.service})
        reg.step_seconds.observe(seconds, tags={"service": self.service})

    def cpu_kernels(self, available: bool) -> None:
        _registry().cpu_kernels.set(int(available), tags={"service": self.service})

    def images(self, method: str, n: int) -> None:
        if n:
            _registry().images.inc(n, tags={"service": self.service, "method": method})

    def batch(self, method: str, images: int, waits: list[float]) -> None:
        """One model call of `images` images, made for requests that each waited `waits[i]` seconds for it."""
        reg, tags = _registry(), {"service": self.service, "method": method}
        reg.batch_size.observe(images, tags=tags)
        if images:
            reg.batch_images.inc(images, tags=tags)
        for seconds in waits:
            reg.batch_wait.observe(seconds, tags=tags)
