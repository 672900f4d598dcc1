"""A client that goes away mid-request cancels the work behind the HTTP API: the text engine frees the request's
KV blocks within a second, and the diffusion loop stops denoising."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from genserve.services.client import Client

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


def test_disconnecting_from_an_image_request_stops_the_denoising(stack) -> None:
    before = stack.settled_metric(STEPS)
    # 8 images of 200 steps: many seconds of denoising on 2 cores. The connection is closed once the step counter
    # moves (the request may wait to join the loop first, longer on a busy machine).
    body = json.dumps({"prompt": "a large red circle", "n": 8, "steps": 200, "seed": 1}).encode()
    head = (f"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", stack.http_port), timeout=60) as connection:
        connection.sendall(head + body)
        deadline = time.monotonic() + 60
        while stack.metric(STEPS) == before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stack.metric(STEPS) > before, "the denoising never started"
    ran = stack.settled_metric(STEPS) - before
    assert ran < 100, f"{ran} steps ran: the denoising went on after the client left"
