"""Batching through the real stack: concurrent seeded requests get byte-identical answers to the same requests made
one at a time, and the replicas made fewer model calls than there were requests (genserve_batch_size's count)."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import numpy as np

from genserve.services.client import AsyncClient, Client

N = 12


def concurrently(address: str, calls):
    async def main():
        async with AsyncClient(address, timeout=120) as client:
            return await asyncio.gather(*(call(client) for call in calls))

    return asyncio.run(main())


def model_calls(stack, service: str) -> float:
    """Model calls of `service` so far: the count of its genserve_batch_size histogram in the Prometheus export."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("ray_genserve_batch_size_count{") and f'service="{service}"' in line)


def calls_after(stack, service: str, before: float) -> float:
    """`model_calls` once it has passed `before` and two exports a metrics interval apart agree."""
    deadline, last = time.monotonic() + 20, model_calls(stack, service)
    while time.monotonic() < deadline:
        time.sleep(1.2)
        now = model_calls(stack, service)
        if now > before and now == last:
            return now
        last = now
    return last


def test_concurrent_seeded_samples_are_byte_identical_to_sequential_ones(stack, client: Client):
    alone = [[img.png for img in client.gan_sample(1, seed=100 + i).images] for i in range(N)]
    alone.append([img.png for img in client.gan_sample(3, seed=7, truncation=0.8).images])
    calls = [lambda c, i=i: c.gan_sample(1, seed=100 + i) for i in range(N)]
    calls.append(lambda c: c.gan_sample(3, seed=7, truncation=0.8))
    before = calls_after(stack, "gan", -1)
    together = [[img.png for img in reply.images] for reply in concurrently(stack.address, calls)]
    assert together == alone
    assert 1 <= calls_after(stack, "gan", before) - before < len(calls)  # some requests shared a model call


def test_concurrent_vae_calls_are_byte_identical_to_sequential_ones(stack, client: Client):
    pngs = [img.png for img in client.gan_sample(N, seed=3).images]
    encoded = [client.vae_encode([p], sample=True, seed=i) for i, p in enumerate(pngs)]
    alone = [client.vae_reconstruct([p]).SerializeToString() for p in pngs]
    alone += [e.SerializeToString() for e in encoded]
    alone += [client.vae_decode(e.latents.shape, _values(e.latents)).SerializeToString() for e in encoded]
    calls = [lambda c, p=p: c.vae_reconstruct([p]) for p in pngs]
    calls += [lambda c, i=i, p=p: c.vae_encode([p], sample=True, seed=i) for i, p in enumerate(pngs)]
    calls += [lambda c, e=e: c.vae_decode(e.latents.shape, _values(e.latents)) for e in encoded]
    before = calls_after(stack, "vae", -1)
    together = [reply.SerializeToString() for reply in concurrently(stack.address, calls)]
    assert together == alone
    assert 1 <= calls_after(stack, "vae", before) - before < len(calls)  # some requests shared a model call


def _values(tensor) -> list[float]:
    return np.frombuffer(tensor.data, dtype=np.float32).tolist()
