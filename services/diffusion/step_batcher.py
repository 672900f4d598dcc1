"""Step-level continuous batching: one denoising loop serves many diffusion requests, one U-Net call per step.

The loop runs in its own thread. At every step boundary it drops the requests whose client cancelled, lets waiting
requests join while their U-Net rows fit the budget (`max_rows`: images × passes, FIFO), then runs every active
request's rows (prompts, unconditional texts, negatives) in ONE U-Net call per latent shape (requests of different
image sizes cannot share a call), and hands each request its own rows of the answer for its own sampler step
(services/diffusion/denoising.py). A request keeps its own timesteps, sampler and its state, step count, guidance
mode, scale and negative prompt, seed, and LoRA: requests with different LoRAs (or none) still share the call, each
LoRA's delta added on its request's rows only (services/diffusion/lora_rows.py); it leaves the batch when its last step
is done, and the loop goes on with the others. This is the continuous batching of Orca (Yu et al., OSDI 2022) at
denoising-step rather than token granularity.

When the loop is idle, the first request waits `wait_s` for others to start with it; a request that arrives while
the loop runs joins at the next step boundary, so its first step starts within one step's time (plus `wait_s` when
the loop was idle), and it hears so then (`on_step` with step 0). The U-Net is batch-invariant to about 1e-6 on the
CPU, so a request's image does not depend on what it was batched with (tests/services/diffusion/test_step_batcher.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from genserve.services.diffusion.denoising import Denoising
from genserve.services.diffusion.params import GenerationCancelled
from genserve.shared.blocks.cross_attention import ContextCache, CrossAttention

UNet = Callable[..., torch.Tensor]  # (x, timesteps, context, *, temb) -> output, like genserve.shared.blocks.unet.UNet


class StackedContext(ContextCache):
    """Several requests' ContextCaches read as one context, in row order: a cross-attention layer gets each
    request's own cached keys and values stacked, so no request's text is projected again."""

    def __init__(self, caches: list[ContextCache]) -> None:
        self.caches = caches
        self._kv: dict[CrossAttention, tuple[torch.Tensor, torch.Tensor]] = {}

    def keys_values(self, attn: CrossAttention) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._kv.get(attn)
        if kv is None:
            keys, values = zip(*(cache.keys_values(attn) for cache in self.caches), strict=True)
            kv = self._kv[attn] = (torch.cat(keys), torch.cat(values))
        return kv


@dataclass(eq=False)
class StepJob:
    state: Denoising
    on_step: Callable[[int, int, torch.Tensor], None] | None
    should_cancel: Callable[[], bool] | None
    future: Future = field(default_factory=Future)  # the final un-scaled latents, or the request's exception
    since: float = field(default_factory=time.perf_counter)

    def cancelled(self) -> bool:
        return self.should_cancel is not None and self.should_cancel()

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


def _group_key(job: StepJob) -> tuple[int, ...]:
    """Requests that can share a U-Net call: same latent shape, same text length; a request with a step cache
    (services/diffusion/step_cache.py) has calls of its own, since its cache holds its rows alone."""
    cache = getattr(job.state.context, "step_cache", None)
    return (*job.state.latent_shape, job.state.context.context.shape[1], 0 if cache is None else id(cache))


class StepBatcher:
    """`submit(state)` -> a Future of the request's final latents, served by one shared denoising loop.

    `on_batch(images, waits)`, if given, sees every U-Net call: the images it denoises and, for each request that
    joined at that step, its seconds from submit to its first step (the metrics, services/common/metrics.py).
    `unet_rows(states)` (DiffusionPipeline.unet_rows), needed when requests carry LoRAs, is the context each U-Net
    call runs in: every request's LoRA on its own rows of the shared call (services/diffusion/lora_rows.py)."""

    def __init__(self, unet: UNet, max_rows: int, wait_s: float,
                 on_batch: Callable[[int, list[float]], None] | None = None,
                 unet_rows: Callable[[Sequence[Denoising]], AbstractContextManager] | None = None) -> None:
        if max_rows < 1 or wait_s < 0:
            raise ValueError(f"need max_rows >= 1 and wait_s >= 0, got {max_rows} and {wait_s}")
        self.unet, self.max_rows, self.wait_s, self.on_batch = unet, max_rows, wait_s, on_batch
        self.unet_rows = unet_rows
        self._cv = threading.Condition()
        self._pending: list[StepJob] = []
        self._active: list[StepJob] = []
        self._joined: list[StepJob] = []  # the requests admitted at the current step boundary
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, state: Denoising, on_step: Callable[[int, int, torch.Tensor], None] | None = None,
               should_cancel: Callable[[], bool] | None = None) -> Future:
        """Queue one prepared request (DiffusionPipeline.prepare). `on_step(step, total, latents)` runs in the loop
        with its un-scaled latents: with step 0 when it joins the loop (its first step starts), then after each of
        its steps; `should_cancel()` is read at every step boundary and ends the request with `GenerationCancelled`."""
        if state.rows > self.max_rows:
            raise ValueError(f"a request of {state.rows} U-Net rows does not fit a step of at most {self.max_rows}")
        if state.lora is not None and self.unet_rows is None:
            raise ValueError("a request with a LoRA needs a step batcher given the pipeline's unet_rows")
        job = StepJob(state, on_step, should_cancel)
        with self._cv:
            if self._closed:
                raise RuntimeError("the step batcher is closed")
            self._pending.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="step-batcher", daemon=True)
                self._thread.start()
            self._cv.notify()
        return job.future

    @property
    def active_rows(self) -> int:
        """U-Net rows per step of the requests in the loop now."""
        with self._cv:
            return sum(job.state.rows for job in self._active)

    def close(self) -> None:
        """Stop the loop; requests still queued or running fail (tests; a replica simply exits)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    def _serve(self) -> None:
        with torch.inference_mode():
            while self._next_batch():
                self._step()
        for job in self._pending + self._active:
            job.fail(RuntimeError("the step batcher is closed"))

    def _next_batch(self) -> bool:
        """At a step boundary: wait for work when idle, then drop cancelled requests and admit waiting ones.
        False once closed."""
        with self._cv:
            if not self._active:
                while not self._pending and not self._closed:
                    self._cv.wait()
                deadline = self._pending[0].since + self.wait_s if self._pending else 0.0
                while not self._closed and self._waiting_rows() < self.max_rows:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    self._cv.wait(left)
            if self._closed:
                return False
            for job in [j for j in self._pending + self._active if j.cancelled()]:
                job.fail(GenerationCancelled(f"cancelled before step {job.state.index + 1} of {job.state.steps}"))
                (self._active if job in self._active else self._pending).remove(job)
            self._joined = []
            used = sum(job.state.rows for job in self._active)
            while self._pending and used + self._pending[0].state.rows <= self.max_rows:
                job = self._pending.pop(0)
                used += job.state.rows
                self._active.append(job)
                self._joined.append(job)
            return True

    def _waiting_rows(self) -> int:
        return sum(job.state.rows for job in self._pending)

    def _step(self) -> None:
        """One U-Net call per group of active requests, each request's own sampler step, then the finished leave."""
        with self._cv:
            active = list(self._active)
        now = time.perf_counter()
        groups: dict[tuple[int, ...], list[StepJob]] = {}
        for job in active:
            groups.setdefault(_group_key(job), []).append(job)
        finished: list[StepJob] = []
        for job in active:
            if job in self._joined and job.on_step is not None:
                try:  # step 0: the request's denoising starts now (its first event comes within one step)
                    job.on_step(0, job.state.steps, job.state.unscaled())
                except Exception as exc:
                    job.fail(exc)
                    finished.append(job)
                    groups[_group_key(job)].remove(job)
        for jobs in (jobs for jobs in groups.values() if jobs):
            if self.on_batch is not None:
                self.on_batch(sum(j.state.images for j in jobs), [now - j.since for j in jobs if j in self._joined])
            try:
                outs = self._call(jobs)
            except Exception as exc:  # the shared call failed: every request in it gets the error
                for job in jobs:
                    job.fail(exc)
                finished += jobs
                continue
            _wait_for_device(outs[0])
            for job, out in zip(jobs, outs, strict=True):
                try:
                    job.state.advance(out)
                    if job.on_step is not None:
                        job.on_step(job.state.index, job.state.steps, job.state.unscaled())
                except Exception as exc:  # one request's own failure (its sampler, its preview) ends it alone
                    job.fail(exc)
                    finished.append(job)
                    continue
                if job.state.done:
                    job.future.set_result(job.state.unscaled())
                    finished.append(job)
        with self._cv:
            self._active = [job for job in self._active if job not in finished]

    def _call(self, jobs: list[StepJob]) -> list[torch.Tensor]:
        """Every request's rows in one U-Net call; each request's own rows of the answer back, in order."""
        inputs = [job.state.model_input() for job in jobs]
        adapted = nullcontext() if self.unet_rows is None else self.unet_rows([job.state for job in jobs])
        if len(jobs) == 1:
            x, t, temb = inputs[0]
            with adapted:
                return [self.unet(x, t, jobs[0].state.context, temb=temb)]
        x = torch.cat([x for x, _, _ in inputs])
        t = torch.cat([t for _, t, _ in inputs])
        temb = torch.cat([temb.expand(len(rows), -1) for rows, _, temb in inputs])
        with adapted:
            out = self.unet(x, t, StackedContext([job.state.context for job in jobs]), temb=temb)
        return list(out.split([job.state.rows for job in jobs]))


def _wait_for_device(out: torch.Tensor) -> None:
    """Block this loop thread until the U-Net call that made ``out`` has run: CUDA only queues kernels, so without it
    a progress event would say when a step was queued, not when it was done, and the thread would run steps ahead
    until the first host copy stalled whoever made it (the replica's event loop, for the last latents)."""
    if out.is_cuda:
        torch.cuda.current_stream(out.device).synchronize()
