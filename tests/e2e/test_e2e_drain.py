"""Graceful drain and SDK retries, on the session stack as its last user (pytest.mark.ends_stack orders this module
after every other that uses it): the retry test kills one of its replicas, and the drain test ends it with SIGTERM.
Calls cut short at the drain's deadline (CANCELLED) are tested in tests/services/common/test_common_drain.py: on a
stack, no call here outlasts a drain time that the 8 streams are sure to fit in on a busy machine.

Processes are the stack's own: the serve process's descendants (other stacks may run Ray on the same machine)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genserve.services.client import Client
from genserve.services.client.errors import GenserveError
from genserve.v1 import text_pb2, text_pb2_grpc
from tests.e2e.serve_configs import DRAIN_S

pytestmark = [pytest.mark.e2e, pytest.mark.ends_stack]

STREAMS = 8
# The grammar holds the demo model to about 190 tokens, no early EOS: ~11 s for all 8 at once on 2 busy cores.
SHORT = r"(the cat sat on the mat\. ){10}"
TEXT, HEALTH = (("application", "text"),), (("application", "health"),)
# The text service's health (the empty name covers all four model apps).
TEXT_HEALTH = health_pb2.HealthCheckRequest(service="genserve.v1.TextGeneration")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
EXIT_TIMEOUT_S = 90.0
KILL_LOOP_S = 20.0


def processes(stack: Any) -> list[psutil.Process]:
    return psutil.Process(stack.process.pid).children(recursive=True)


def replica(stack: Any, name: str) -> psutil.Process | None:
    """The worker process of a replica, e.g. `ServeReplica:gan:ImageGan` (Ray sets it as the process title)."""
    for process in processes(stack):
        try:
            if name in " ".join(process.cmdline()):
                return process
        except psutil.Error:
            continue
    return None


def test_idempotent_calls_ride_over_a_killed_replica(stack: Any) -> None:
    """kill -9 of the gan replica while two clients loop over seeded GAN samples, GetModelInfo and Tokenize: the
    SDK's retry policy carries every call (the proxy reports the call cut off by the death as INTERNAL, the others
    wait for a live replica)."""
    victim = replica(stack, "ServeReplica:gan:ImageGan")
    assert victim is not None
    stop, ok, failures = threading.Event(), [0], []

    def loop(client_seed: int) -> None:
        with Client(stack.address, timeout=60) as client:
            i = 0
            while not stop.is_set():
                try:
                    client.gan_sample(2, seed=client_seed * 100_000 + i)
                    client.model_info()
                    client.tokenize("the drain test")
                    ok[0] += 1
                except GenserveError as error:
                    failures.append(str(error))
                i += 1

    threads = [threading.Thread(target=loop, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(3)
        before = ok[0]
        victim.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + KILL_LOOP_S
        while time.monotonic() < deadline:
            back = replica(stack, "ServeReplica:gan:ImageGan")
            if back is not None and back.pid != victim.pid and ok[0] > before + 20:
                break
            time.sleep(0.5)
        time.sleep(2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert not victim.is_running()
    assert failures == []
    assert ok[0] > before + 20  # calls went on through the restart
    back = replica(stack, "ServeReplica:gan:ImageGan")
    assert back is not None and back.pid != victim.pid


async def first_then(call: grpc.aio.UnaryStreamCall, started: asyncio.Event) -> tuple[str, int, str, float]:
    """(code, messages, finish_reason or details, loop time of the end) of a stream, marking its first message."""
    messages, last = 0, ""
    try:
        async for message in call:
            messages += 1
            last = getattr(message, "finish_reason", "") or last
            started.set()
        return "OK", messages, last, time.monotonic()
    except grpc.aio.AioRpcError as error:
        started.set()
        return error.code().name, messages, error.details() or "", time.monotonic()


async def until_refused(stub: text_pb2_grpc.TextGenerationStub, within_s: float) -> grpc.aio.AioRpcError | None:
    """A plain GetModelInfo (no retries) every 0.2 s until one is refused; the replica learns of the drain within
    its poll interval."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            await stub.GetModelInfo(text_pb2.ModelInfoRequest(), metadata=TEXT, timeout=10)
        except grpc.aio.AioRpcError as error:
            return error
        await asyncio.sleep(0.2)
    return None


def http_status(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, ""
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


async def drain_scenario(stack: Any) -> dict:
    seen: dict = {}
    options = [("grpc.enable_retries", 0)]
    async with (grpc.aio.insecure_channel(stack.address, options=options) as channel,
                grpc.aio.insecure_channel(stack.health_address, options=options) as health_channel):
        text = text_pb2_grpc.TextGenerationStub(channel)
        port_watch = health_pb2_grpc.HealthStub(health_channel).Watch(TEXT_HEALTH, timeout=300)
        app_watch = health_pb2_grpc.HealthStub(channel).Watch(TEXT_HEALTH, metadata=HEALTH, timeout=300)
        seen["watch_before"] = [(await port_watch.read()).status, (await app_watch.read()).status]

        started = [asyncio.Event() for _ in range(STREAMS)]
        streams = [
            asyncio.ensure_future(first_then(text.GenerateStream(
                text_pb2.TextRequest(prompt="Once upon a time", max_tokens=900, seed=i, regex=SHORT),
                metadata=TEXT, timeout=300), started[i]))
            for i in range(STREAMS)
        ]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
        seen["unfinished_at_sigterm"] = sum(not s.done() for s in streams)

        before = processes(stack)
        stack.process.send_signal(signal.SIGTERM)
        sigterm = seen["sigterm"] = time.monotonic()

        seen["watch_after"] = [(await port_watch.read()).status, (await app_watch.read()).status]
        seen["watch_after_s"] = time.monotonic() - sigterm
        seen["refused"] = await until_refused(text, within_s=5)
        check = health_pb2_grpc.HealthStub(health_channel).Check(TEXT_HEALTH, timeout=10)
        seen["check"] = (await check).status
        seen["http"] = await asyncio.to_thread(http_status, stack.http_url + "/models")

        seen["streams"] = await asyncio.gather(*streams)
        port_watch.cancel()
        app_watch.cancel()
    seen["exit_code"] = await asyncio.to_thread(stack.process.wait, EXIT_TIMEOUT_S)
    seen["exit_s"] = time.monotonic() - sigterm
    seen["before"] = before
    return seen


def test_sigterm_drains_calls_in_flight_refuses_new_ones_and_leaves_no_ray_process(stack: Any) -> None:
    seen = asyncio.run(drain_scenario(stack))
    assert seen["unfinished_at_sigterm"] == STREAMS
    assert seen["watch_before"] == [SERVING, SERVING]
    assert seen["watch_after"] == [NOT_SERVING, NOT_SERVING]
    refused = seen["refused"]
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "draining" in refused.details()
    assert seen["check"] == NOT_SERVING
    status, body = seen["http"]
    assert status == 503 and "draining" in body

    for code, messages, finish_reason, ended in seen["streams"]:
        assert (code, finish_reason) == ("OK", "stop") and messages > 50
        assert ended - seen["sigterm"] < DRAIN_S
    assert seen["exit_code"] == 0
    # The drain ended with the last call, not at the deadline (the shutdown after it takes seconds).
    assert seen["exit_s"] < max(ended for *_, ended in seen["streams"]) - seen["sigterm"] + 30
    deadline = time.monotonic() + 15
    while any(p.is_running() for p in seen["before"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [p.pid for p in seen["before"] if p.is_running()] == []
    assert len(seen["before"]) >= 8  # raylet, GCS, the controller, the proxy and the replicas were counted
