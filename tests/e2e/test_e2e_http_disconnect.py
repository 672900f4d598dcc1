"""A client that goes away mid-request cancels the work behind the HTTP API: the text engine frees the request's
KV blocks within a second, and the diffusion loop stops denoising."""

from __future__ import annotations

import time

import httpx
import pytest

from services.client import Client

pytestmark = pytest.mark.e2e

STEPS = "ray_genserve_diffusion_steps_total"


def test_disconnecting_from_a_streaming_chat_frees_its_kv_blocks_within_a_second(stack, client: Client) -> None:
    info = client.model_info()
    body = {"model": "text", "messages": [{"role": "user", "content": "Tell a long story"}], "stream": True,
            "max_tokens": min(1024, info.max_context - 64), "temperature": 1.0, "seed": 3}
    with httpx.Client(base_url=stack.http_url, timeout=60) as http:
        with http.stream("POST", "/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
            assert client.model_info().kv_blocks_free < info.kv_blocks_total  # the stream holds blocks
            closed = time.monotonic()
        # leaving the block closes the connection mid-stream
    while client.model_info().kv_blocks_free != info.kv_blocks_total and time.monotonic() - closed < 1.0:
        time.sleep(0.02)
    assert client.model_info().kv_blocks_free == info.kv_blocks_total
    assert time.monotonic() - closed < 1.0


def steps_settled(stack, interval_s: float = 1.0, timeout_s: float = 10.0) -> float:
    """The diffusion step counter once two exports a metrics interval apart agree."""
    deadline = time.monotonic() + timeout_s
    last = stack.metric(STEPS)
    while time.monotonic() < deadline:
        time.sleep(interval_s + 0.2)
        now = stack.metric(STEPS)
        if now == last:
            return now
        last = now
    raise AssertionError(f"{STEPS} still moving after {timeout_s} s")


def test_disconnecting_from_an_image_request_stops_the_denoising(stack) -> None:
    before = steps_settled(stack)
    # 8 images of 200 steps: many seconds of denoising on 2 cores, cut after half a second.
    body = {"prompt": "a large red circle", "n": 8, "steps": 200, "seed": 1}
    with httpx.Client(base_url=stack.http_url, timeout=httpx.Timeout(60, read=0.5)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/images/generations", json=body)
    ran = steps_settled(stack) - before
    assert 1 <= ran < 100, f"{ran} steps ran after the client left"
