"""The gan app batches concurrent requests (services/common/batcher.py) and every request still gets the PNG bytes
it would have got alone: the generator is batch-invariant (kernels/cpu_conv.py, RowwiseLinear)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from genserve.services.common.batcher import BatchArgs
from genserve.services.common.errors import to_status
from genserve.services.gan.app import ImageGan
from genserve.services.gan.model import load_generator
from genserve.services.gan.sampling import generate, sample_latents
from genserve.shared.blocks.linear import RowwiseLinear
from genserve.v1 import gan_pb2


def app(wait_s: float = 0.2, max_images: int = 32) -> ImageGan:
    service = ImageGan.func_or_class(None, BatchArgs(max_batch_images=max_images, batch_wait_s=wait_s))
    service.batch_sizes = []
    record = service.metrics.batch
    service.metrics.batch = lambda method, n, waits: (service.batch_sizes.append(n), record(method, n, waits))
    return service


REQUESTS = [gan_pb2.GanSampleRequest(num_images=1, seed=s) for s in range(6)] + [
    gan_pb2.GanSampleRequest(num_images=3, seed=41, truncation=0.7),
    gan_pb2.GanSampleRequest(num_images=2, seed=7, truncation=1.5),
]


def pngs(response) -> list[bytes]:
    return [image.png for image in response.images]


@pytest.mark.parametrize("threads", [1, 2])
def test_the_generator_gives_each_latent_the_same_bits_in_any_batch(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = load_generator(None)
        z = sample_latents(40, 0, None, generator.config.z_dim)
        with torch.inference_mode():
            whole = generate(generator, z)
            for n in (1, 2, 3, 5, 8, 16, 17):
                assert torch.equal(generate(generator, z[:n]), whole[:n]), n
            order = torch.randperm(40)
            assert torch.equal(generate(generator, z[order]), whole[order])
    finally:
        torch.set_num_threads(before)


def test_rowwise_linear_is_nn_linear_and_independent_of_the_other_rows():
    torch.manual_seed(0)
    layer, x = RowwiseLinear(48, 96), torch.randn(20, 48)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    with torch.no_grad():
        whole = layer(x)
        assert all(torch.equal(layer(x[:n]), whole[:n]) for n in range(1, 20))


def test_concurrent_sample_requests_share_model_calls_and_keep_their_own_bytes():
    alone = app(wait_s=0.0)

    async def one_at_a_time():
        return [pngs(await alone.Sample(r)) for r in REQUESTS]

    async def together(service):
        return [pngs(r) for r in await asyncio.gather(*(service.Sample(r) for r in REQUESTS))]

    expected = asyncio.run(one_at_a_time())
    assert alone.batch_sizes == [1] * 6 + [3, 2]
    batched = app()
    assert asyncio.run(together(batched)) == expected
    assert batched.batch_sizes == [sum(r.num_images for r in REQUESTS)]  # 11 images, one generator call
    small = app(max_images=4)
    assert asyncio.run(together(small)) == expected
    assert max(small.batch_sizes) <= 4 and sum(small.batch_sizes) == 11


def test_interpolate_and_sample_batch_together():
    alone = app(wait_s=0.0)
    path = gan_pb2.GanInterpolateRequest(seed_start=3, seed_end=11, steps=5)
    sample = gan_pb2.GanSampleRequest(num_images=2, seed=9)

    async def separately():
        return pngs(await alone.Interpolate(path)), pngs(await alone.Sample(sample))

    async def together(service):
        a, b = await asyncio.gather(service.Interpolate(path), service.Sample(sample))
        return pngs(a), pngs(b)

    service = app()
    assert asyncio.run(together(service)) == asyncio.run(separately())
    assert service.batch_sizes == [7]


def test_a_request_larger_than_a_batch_is_split_and_unchanged():
    request = gan_pb2.GanSampleRequest(num_images=10, seed=5)
    whole, split = app(wait_s=0.0, max_images=32), app(wait_s=0.0, max_images=4)
    assert pngs(asyncio.run(split.Sample(request))) == pngs(asyncio.run(whole.Sample(request)))
    assert split.batch_sizes == [4, 4, 2]


def test_an_invalid_request_fails_alone_and_its_batch_mates_succeed():
    service = app()
    good = gan_pb2.GanSampleRequest(num_images=2, seed=1)
    bad = gan_pb2.GanSampleRequest(num_images=1, seed=2, truncation=0.01)

    async def main():
        return await asyncio.gather(service.Sample(good), service.Sample(bad), service.Sample(good),
                                    return_exceptions=True)

    first, failed, second = asyncio.run(main())
    status = to_status(failed, "rid")
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT and "truncation" in status.details
    assert pngs(first) == pngs(second) and len(first.images) == 2
    assert service.batch_sizes == [4]
