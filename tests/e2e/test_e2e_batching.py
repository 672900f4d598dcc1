"""Batching through the real stack: concurrent seeded requests get byte-identical answers to the same requests made
one at a time, and the replicas report batches of more than one image (genserve_batch_size)."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import numpy as np

from services.client import AsyncClient, Client

N = 12


def concurrently(address: str, calls):
    async def main():
        async with AsyncClient(address, timeout=120) as client:
            return await asyncio.gather(*(call(client) for call in calls))

    return asyncio.run(main())


def batch_mean(stack, service: str) -> float:
    """Mean images per model call of `service` so far, from the Prometheus export (0 before any is reported)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10) as response:
        lines = [line for line in response.read().decode().splitlines() if f'service="{service}"' in line]

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))

    count = total("ray_genserve_batch_size_count")
    return total("ray_genserve_batch_size_sum") / count if count else 0.0


def wait_for_batches(stack, service: str) -> float:
    deadline = time.monotonic() + 20  # metrics reach the exporter once a second
    while batch_mean(stack, service) <= 1.0 and time.monotonic() < deadline:
        time.sleep(1)
    return batch_mean(stack, service)


def test_concurrent_seeded_samples_are_byte_identical_to_sequential_ones(stack, client: Client):
    alone = [[img.png for img in client.gan_sample(1, seed=100 + i).images] for i in range(N)]
    alone.append([img.png for img in client.gan_sample(3, seed=7, truncation=0.8).images])
    calls = [lambda c, i=i: c.gan_sample(1, seed=100 + i) for i in range(N)]
    calls.append(lambda c: c.gan_sample(3, seed=7, truncation=0.8))
    together = [[img.png for img in reply.images] for reply in concurrently(stack.address, calls)]
    assert together == alone
    assert wait_for_batches(stack, "gan") > 1.0


def test_concurrent_vae_calls_are_byte_identical_to_sequential_ones(stack, client: Client):
    pngs = [img.png for img in client.gan_sample(N, seed=3).images]
    encoded = [client.vae_encode([p], sample=True, seed=i) for i, p in enumerate(pngs)]
    alone = [client.vae_reconstruct([p]).SerializeToString() for p in pngs]
    alone += [e.SerializeToString() for e in encoded]
    alone += [client.vae_decode(e.latents.shape, _values(e.latents)).SerializeToString() for e in encoded]
    calls = [lambda c, p=p: c.vae_reconstruct([p]) for p in pngs]
    calls += [lambda c, i=i, p=p: c.vae_encode([p], sample=True, seed=i) for i, p in enumerate(pngs)]
    calls += [lambda c, e=e: c.vae_decode(e.latents.shape, _values(e.latents)) for e in encoded]
    together = [reply.SerializeToString() for reply in concurrently(stack.address, calls)]
    assert together == alone
    assert wait_for_batches(stack, "vae") > 1.0


def _values(tensor) -> list[float]:
    return np.frombuffer(tensor.data, dtype=np.float32).tolist()
