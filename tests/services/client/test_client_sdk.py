"""The SDK against an in-process fake server: metadata, optional fields, streaming, error mapping."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from genserve.services.client import AsyncClient, Client
from genserve.services.client import errors as client_errors
from genserve.services.client.requests import diffusion_request, gan_sample_request, text_request
from genserve.services.client.sync import metadata


def test_requests_leave_unset_options_unset() -> None:
    request = text_request("hi", max_tokens=4)
    assert request.HasField("max_tokens") and not request.HasField("temperature")
    assert text_request("hi", temperature=0.0).HasField("temperature")
    assert not gan_sample_request().HasField("num_images")
    request = diffusion_request("a cat", steps=3)
    assert request.steps == 3 and not request.HasField("guidance_scale") and not request.HasField("seed")
    assert request.guidance == "" and not request.HasField("negative_weight")
    request = diffusion_request("a cat", guidance="perp_neg", negative_weight=0.0)
    assert request.guidance == "perp_neg" and request.HasField("negative_weight") and request.negative_weight == 0.0


def test_sync_client_sends_the_application_metadata(fake_server) -> None:
    address, seen = fake_server
    with Client(address, timeout=5) as client:
        reply = client.generate("abc", max_tokens=3, stop=["x"])
    assert reply.text == "cba" and list(reply.token_ids) == [1, 2]
    application, request = seen[0]
    assert application == "text" and request.max_tokens == 3 and list(request.stop) == ["x"]


def test_sync_stream_yields_chunks_in_order(fake_server) -> None:
    address, _ = fake_server
    with Client(address, timeout=5) as client:
        chunks = list(client.generate_stream("hey"))
    assert [c.text for c in chunks] == ["h", "e", "y"]
    assert [c.finish_reason for c in chunks] == ["", "", "length"]


@pytest.mark.parametrize(
    ("prompt", "options", "error", "code"),
    [
        ("hi", {"temperature": -1.0}, client_errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
        ("busy", {}, client_errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
)
def test_errors_map_to_exceptions(fake_server, prompt, options, error, code) -> None:
    address, _ = fake_server
    with Client(address, timeout=5) as client, pytest.raises(error) as info:
        client.generate(prompt, **options)
    assert info.value.code == code
    assert isinstance(info.value, client_errors.GenserveError)


def test_unimplemented_and_unreachable(fake_server) -> None:
    address, _ = fake_server
    with Client(address, timeout=5) as client, pytest.raises(client_errors.GenserveError) as info:
        client.vae_reconstruct([b"x"])
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
    with Client("127.0.0.1:1", timeout=2) as client, pytest.raises(client_errors.Unavailable):
        client.gan_sample(1)


def test_async_client_unary_and_stream(fake_server) -> None:
    address, seen = fake_server

    async def run():
        async with AsyncClient(address, timeout=5) as client:
            reply = await client.generate("ab")
            chunks = [c.text async for c in client.generate_stream("xyz")]
            images = await client.gan_sample(3)
            with pytest.raises(client_errors.InvalidArgument):
                await client.generate("hi", temperature=-2.0)
        return reply, chunks, images

    reply, chunks, images = asyncio.run(run())
    assert reply.text == "ba" and chunks == ["x", "y", "z"] and len(images.images) == 3
    assert {application for application, _ in seen} == {"text"}


def test_the_api_key_goes_as_a_bearer_token_from_the_argument_or_the_env(fake_server, monkeypatch) -> None:
    address, _ = fake_server
    monkeypatch.delenv("GENSERVE_API_KEY", raising=False)
    with Client(address, timeout=5) as client:
        assert client.model_info().model_name == "fake-model"  # no key: no authorization metadata at all
    with Client(address, timeout=5, api_key="k1") as client:
        assert client.model_info().model_name == "Bearer k1"
    monkeypatch.setenv("GENSERVE_API_KEY", "k2")
    with Client(address, timeout=5) as client:
        assert client.model_info().model_name == "Bearer k2"
        assert [c.text for c in client.generate_stream("ab")] == ["a", "b"]

    async def aio() -> tuple[str, str]:
        async with AsyncClient(address, timeout=5) as from_env, AsyncClient(address, api_key="k3") as given:
            return (await from_env.model_info()).model_name, (await given.model_info()).model_name

    assert asyncio.run(aio()) == ("Bearer k2", "Bearer k3")


def test_a_refusal_carries_the_servers_retry_after(fake_server) -> None:
    address, _ = fake_server
    with Client(address, timeout=5) as client, pytest.raises(client_errors.ResourceExhausted) as info:
        client.generate("busy")
    assert info.value.retry_after_s == 3.0
    with Client(address, timeout=5) as client, pytest.raises(client_errors.InvalidArgument) as info:
        client.generate("hi", temperature=-1.0)
    assert info.value.retry_after_s is None

    async def aio() -> float | None:
        async with AsyncClient(address, timeout=5) as client:
            with pytest.raises(client_errors.ResourceExhausted) as refused:
                await client.generate("busy")
        return refused.value.retry_after_s

    assert asyncio.run(aio()) == 3.0


def test_an_adapter_goes_in_the_request_and_as_the_multiplexed_model_id() -> None:
    assert text_request("hi", adapter="sql").adapter == "sql" and not text_request("hi").HasField("adapter")
    assert metadata("text", "k", "sql") == (("application", "text"), ("authorization", "Bearer k"),
                                            ("multiplexed_model_id", "sql"))
    assert metadata("text") == (("application", "text"),)


def test_adapters_load_and_unload_sync_and_async(fake_server) -> None:
    address, _ = fake_server
    with Client(address, timeout=5) as client:
        assert client.load_adapter("a", "loras/a") == ["a"]
        assert list(client.model_info().adapters) == ["a"]

    async def unload() -> list[str]:
        async with AsyncClient(address, timeout=5) as client:
            await client.load_adapter("b", "loras/b")
            return await client.unload_adapter("a")

    assert asyncio.run(unload()) == ["b"]
    with Client(address, timeout=5) as client, pytest.raises(client_errors.NotFound):
        client.unload_adapter("a")
