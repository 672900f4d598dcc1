"""Bad requests over raw HTTP (httpx): each gets OpenAI's error object with the documented status, and the next
good request still succeeds. Overload answers 429 with Retry-After."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import pytest

from genserve.services.http.schemas import MAX_BODY_BYTES
from tests.e2e.test_e2e_overload import CAPACITY, DIFFUSION, EXTRA, PATIENCE_S, SPACING_S

pytestmark = pytest.mark.e2e

CHAT = {"model": "text", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
IMAGE = {"prompt": "a small green triangle", "steps": 1, "seed": 2}
OVERLOAD_SETTLE_S = 3.0


@dataclass(frozen=True)
class Case:
    path: str
    body: bytes
    status: int
    param: str | None
    code: str | None = None


def body(**fields) -> bytes:
    import json

    return json.dumps(fields).encode()


CASES = {
    "malformed-json": Case("/chat/completions", b'{"model": "text", "messages": [', 400, None, "json_invalid"),
    "not-an-object": Case("/chat/completions", b"[1, 2]", 400, None),
    "string-temperature": Case("/chat/completions", body(**{**CHAT, "temperature": "0.5"}), 400, "temperature"),
    "float-max-tokens": Case("/completions", body(model="text", prompt="hi", max_tokens=2.5), 400, "max_tokens"),
    "bool-as-prompt": Case("/completions", body(model="text", prompt=True), 400, "prompt"),
    "messages-not-a-list": Case("/chat/completions", body(model="text", messages="hi"), 400, "messages"),
    "role-unknown": Case("/chat/completions", body(model="text", messages=[{"role": "robot", "content": "x"}]),
                         400, "messages[0].role"),
    "missing-model": Case("/chat/completions", body(messages=CHAT["messages"]), 400, "model", "missing"),
    "max-tokens-over-limit": Case("/chat/completions", body(**{**CHAT, "max_tokens": 10**6}), 400, "max_tokens"),
    "max-completion-tokens-zero": Case("/chat/completions", body(**{**CHAT, "max_completion_tokens": 0}), 400,
                                       "max_completion_tokens"),
    "top-logprobs-over-limit": Case("/chat/completions", body(**{**CHAT, "logprobs": True, "top_logprobs": 50}),
                                    400, "top_logprobs"),
    "top-logprobs-without-logprobs": Case("/chat/completions", body(**{**CHAT, "top_logprobs": 2}), 400,
                                          "top_logprobs"),
    "temperature-too-high": Case("/completions", body(model="text", prompt="hi", temperature=3), 400,
                                 "temperature"),
    "too-many-stops": Case("/completions", body(model="text", prompt="hi", stop=list("abcde")), 400, "stop"),
    "n-too-large": Case("/chat/completions", body(**{**CHAT, "n": 99}), 400, "n"),
    "prompt-over-context": Case("/completions", body(model="text", prompt="a " * 8000, max_tokens=8), 400, "prompt"),
    "unknown-text-model": Case("/chat/completions", body(**{**CHAT, "model": "gpt-4o"}), 404, None,
                               "model_not_found"),
    "unknown-image-model": Case("/images/generations", body(prompt="x", model="dall-e-3"), 404, None,
                                "model_not_found"),
    "image-size-not-native": Case("/images/generations", body(prompt="a red circle", size="1024x1024"), 400,
                                  "size"),
    "image-url-format": Case("/images/generations", body(prompt="a red circle", response_format="url"), 400,
                             "response_format"),
    "image-too-many": Case("/images/generations", body(prompt="a red circle", n=100), 400, "n"),
    "image-steps-zero": Case("/images/generations", body(prompt="a red circle", steps=0), 400, "steps"),
    "image-unknown-scheduler": Case("/images/generations", body(prompt="a red circle", scheduler="heun"), 400,
                                    "scheduler"),
    "image-unknown-guidance": Case("/images/generations", body(prompt="a red circle", guidance="plain"), 400,
                                   "guidance"),
    "oversized-body": Case("/completions", body(model="text", prompt="a" * (MAX_BODY_BYTES + 1)), 413, None,
                           "request_too_large"),
}


@pytest.fixture(scope="module")
def http(stack) -> httpx.Client:
    with httpx.Client(base_url=stack.http_url, timeout=60) as c:
        yield c


def assert_error_shape(response: httpx.Response, status: int, param: str | None, code: str | None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert "Traceback" not in error["message"] and "/work" not in error["message"] and ".py" not in error["message"]
    if param:
        assert error["message"].startswith(param)
    return error


@pytest.mark.parametrize("name", CASES)
def test_bad_request_gets_the_openai_error_object(http: httpx.Client, name: str) -> None:
    case = CASES[name]
    response = http.post(case.path, content=case.body, headers={"content-type": "application/json"})
    assert_error_shape(response, case.status, case.param, case.code)
    good = http.post("/chat/completions", json=CHAT)
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] is not None


def test_unknown_fields_are_ignored(http: httpx.Client) -> None:
    reply = http.post("/chat/completions", json={**CHAT, "logit_bias": {"1": 5}, "tools_choice_x": [1],
                                                 "parallel_tool_calls": False})
    assert reply.status_code == 200
    assert reply.json() | {"id": "", "created": 0} == http.post("/chat/completions", json=CHAT).json() | {
        "id": "", "created": 0}


def test_chunked_oversized_body_is_refused(http: httpx.Client) -> None:
    def chunks():
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    response = http.post("/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error_shape(response, 413, None, "request_too_large")


async def flood(url: str) -> list[tuple[int | None, float, dict | None, str | None]]:
    """Long image requests in test_e2e_overload's two waves (CAPACITY at once, then EXTRA one by one), each held for
    PATIENCE_S: (status or None, seconds, error, Retry-After); then every connection is closed, which cancels the
    accepted work. An HTTP image reply comes only at the end, so the first wave is given OVERLOAD_SETTLE_S to be
    taken in."""
    slow = {"prompt": "a large red circle", "steps": 200, "seed": 1}
    limits = httpx.Limits(max_connections=CAPACITY + EXTRA)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:

        async def one():
            start = time.perf_counter()
            try:
                async with asyncio.timeout(PATIENCE_S):
                    r = await c.post("/images/generations", json=slow)
            except TimeoutError:
                return None, PATIENCE_S, None, None
            error = r.json().get("error") if r.status_code != 200 else None
            return r.status_code, time.perf_counter() - start, error, r.headers.get("retry-after")

        first = [asyncio.ensure_future(one()) for _ in range(CAPACITY)]
        await asyncio.sleep(OVERLOAD_SETTLE_S)
        second = []
        for _ in range(EXTRA):
            second.append(asyncio.ensure_future(one()))
            await asyncio.sleep(SPACING_S)
        return await asyncio.gather(*first, *second)


def test_overload_answers_429_with_retry_after_then_recovers(stack, http: httpx.Client) -> None:
    results = asyncio.run(flood(stack.http_url))
    refused = [r for r in results if r[0] == 429]
    assert len(refused) >= DIFFUSION.max_queued_requests, results
    assert {status for status, *_ in results} <= {200, 429, None}, results
    first_done = min((seconds for status, seconds, *_ in results if status == 200), default=PATIENCE_S)
    for _, seconds, error, retry_after in refused:
        assert seconds < first_done and retry_after == "1"  # shed, not queued until capacity frees up
        assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
    deadline = time.monotonic() + 15
    while (reply := http.post("/images/generations", json=IMAGE)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert reply.status_code == 200 and len(reply.json()["data"]) == 1
