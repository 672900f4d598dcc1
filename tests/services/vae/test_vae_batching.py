"""The vae app batches concurrent Encode / Decode / Reconstruct requests (services/common/batcher.py); every
request gets the bytes it would have got alone: the VAE is batch-invariant (kernels/cpu_conv.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from genserve.services.common.batcher import BatchArgs
from genserve.services.common.errors import InvalidArgument
from genserve.services.common.images import tensor_message, to_png
from genserve.services.vae.app import Vae
from genserve.services.vae.model import load_vae
from genserve.v1 import common_pb2, vae_pb2


def app(wait_s: float = 0.2) -> Vae:
    service = Vae.func_or_class(None, BatchArgs(max_batch_images=32, batch_wait_s=wait_s))
    service.batches = []
    record = service.metrics.batch
    service.metrics.batch = lambda method, n, waits: (service.batches.append((method, n)), record(method, n, waits))
    return service


def images(seed: int, n: int) -> list[common_pb2.Image]:
    x = torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return [common_pb2.Image(png=to_png(img), width=32, height=32) for img in x]


def latents(seed: int, n: int) -> common_pb2.Tensor:
    return tensor_message(torch.randn(n, 4, 8, 8, generator=torch.Generator().manual_seed(seed)))


REQUESTS = [
    ("Reconstruct", vae_pb2.ReconstructRequest(images=images(0, 1))),
    ("Reconstruct", vae_pb2.ReconstructRequest(images=images(1, 3))),
    ("Encode", vae_pb2.EncodeRequest(images=images(2, 2), sample=True, seed=11)),
    ("Encode", vae_pb2.EncodeRequest(images=images(3, 1))),
    ("Decode", vae_pb2.DecodeRequest(latents=latents(4, 2))),
    ("Decode", vae_pb2.DecodeRequest(latents=latents(5, 1))),
    ("Reconstruct", vae_pb2.ReconstructRequest(images=images(6, 2))),
]


def call(service: Vae, method: str, request):
    return getattr(service, method)(request)


def test_the_vae_gives_each_image_the_same_bits_in_any_batch():
    vae = load_vae(None)
    x = torch.rand(20, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.inference_mode():
        whole, (mean, logvar) = vae.reconstruct(x), vae.encode(x)
        for n in (1, 2, 3, 7, 16):
            assert torch.equal(vae.reconstruct(x[:n]), whole[:n]), n
            assert torch.equal(vae.encode(x[:n])[1], logvar[:n]), n
            assert torch.equal(vae.decode(mean[:n]), vae.decode(mean)[:n]), n


def test_concurrent_requests_of_every_method_keep_their_own_bytes():
    alone = app(wait_s=0.0)

    async def one_at_a_time():
        return [(await call(alone, m, r)).SerializeToString() for m, r in REQUESTS]

    async def together(service):
        replies = await asyncio.gather(*(call(service, m, r) for m, r in REQUESTS))
        return [reply.SerializeToString() for reply in replies]

    expected = asyncio.run(one_at_a_time())
    service = app()
    assert asyncio.run(together(service)) == expected
    assert sorted(service.batches) == [("decode", 3), ("encode", 3), ("reconstruct", 6)]


@pytest.mark.parametrize("bad", [
    vae_pb2.ReconstructRequest(images=[common_pb2.Image(png=b"not a png")]),
    vae_pb2.ReconstructRequest(images=images(9, 1) + [common_pb2.Image(png=b"")]),
])
def test_an_invalid_request_fails_alone_and_its_batch_mates_succeed(bad):
    service = app()
    good = vae_pb2.ReconstructRequest(images=images(7, 2))

    async def main():
        return await asyncio.gather(service.Reconstruct(good), service.Reconstruct(bad), service.Reconstruct(good),
                                    return_exceptions=True)

    first, failed, second = asyncio.run(main())
    assert isinstance(failed, InvalidArgument) and "images[" in str(failed)
    assert first.SerializeToString() == second.SerializeToString() and len(first.images) == 2
    assert service.batches == [("reconstruct", 4)]
