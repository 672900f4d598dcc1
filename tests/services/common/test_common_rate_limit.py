"""Token buckets per caller: requests, generated tokens and images, refusals with the wait until admission."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from genserve.services.common.errors import RateLimited
from genserve.services.common.rate_limit import MAX_CALLERS, Limiter, RateLimits, TokenBucket, generated
from genserve.v1 import common_pb2, diffusion_pb2, text_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def images(n: int) -> common_pb2.ImagesResponse:
    return common_pb2.ImagesResponse(images=[common_pb2.Image(width=8, height=8)] * n)


def test_a_bucket_refills_at_its_rate_up_to_its_capacity() -> None:
    bucket = TokenBucket(rate=2.0, capacity=3.0, level=3.0, stamp=0.0)
    bucket.take(0.0, 3)
    assert bucket.wait(0.0) == pytest.approx(0.5)
    assert bucket.wait(0.25) == pytest.approx(0.25)
    assert bucket.wait(100.0) == 0.0 and bucket.level == 3.0 and bucket.full(100.0)
    bucket.take(100.0, 7)  # into debt: 3 - 7 = -4, so one token is 2.5 s away
    assert bucket.wait(100.0) == pytest.approx(2.5)


def test_requests_past_the_burst_wait_for_the_refill_then_pass() -> None:
    clock = Clock()
    limiter = Limiter(RateLimits(requests_per_minute=30, requests_burst=2), clock)  # one every 2 s
    limiter.admit("a")
    limiter.admit("a")
    with pytest.raises(RateLimited) as caught:
        limiter.admit("a")
    assert (caught.value.what, caught.value.retry_after_s) == ("requests", 2)
    assert str(caught.value) == "rate limit of requests reached for this caller; retry in 2 s"
    limiter.admit("b")  # another caller has its own bucket
    clock.now += 1.0
    with pytest.raises(RateLimited) as caught:
        limiter.admit("a")
    assert caught.value.retry_after_s == 1
    clock.now += 1.0
    limiter.admit("a")


def test_a_refused_request_takes_nothing_from_the_bucket() -> None:
    clock = Clock()
    limiter = Limiter(RateLimits(requests_per_minute=60, requests_burst=1), clock)
    limiter.admit("a")
    for _ in range(5):
        with pytest.raises(RateLimited):
            limiter.admit("a")
    clock.now += 1.0
    limiter.admit("a")


def test_generated_tokens_are_charged_after_and_the_debt_delays_the_next_request() -> None:
    clock = Clock()
    limiter = Limiter(RateLimits(tokens_per_minute=600, tokens_burst=10), clock)  # 10 tokens a second
    limiter.admit("a")
    limiter.charge("a", text_pb2.TextResponse(token_ids=list(range(30))))  # 10 - 30 = -20
    with pytest.raises(RateLimited) as caught:
        limiter.admit("a")
    assert (caught.value.what, caught.value.retry_after_s) == ("tokens", 3)  # 2.1 s to get back to 1
    clock.now += 2.0
    with pytest.raises(RateLimited):
        limiter.admit("a")
    clock.now += 0.2
    limiter.admit("a")


def test_images_are_charged_per_image_and_stream_results_only() -> None:
    clock = Clock()
    limiter = Limiter(RateLimits(images_per_minute=6, images_burst=4), clock)  # one image per 10 s
    limiter.admit("a")
    preview = diffusion_pb2.DiffusionEvent(preview=diffusion_pb2.DiffusionPreview(images=images(3).images))
    limiter.charge("a", preview)
    limiter.charge("a", diffusion_pb2.DiffusionEvent(result=images(3)))
    limiter.admit("a")  # 4 - 3 = 1 left
    limiter.charge("a", images(2))  # -1: two images (20 s) to get back to 1
    with pytest.raises(RateLimited) as caught:
        limiter.admit("a")
    assert (caught.value.what, caught.value.retry_after_s) == ("images", 20)


def test_the_longest_wait_is_reported() -> None:
    clock = Clock()
    limiter = Limiter(RateLimits(requests_per_minute=60, requests_burst=1, tokens_per_minute=60, tokens_burst=1),
                      clock)
    limiter.admit("a")
    limiter.charge("a", text_pb2.TextChunk(token_ids=[1, 2, 3, 4, 5]))
    with pytest.raises(RateLimited) as caught:
        limiter.admit("a")
    assert (caught.value.what, caught.value.retry_after_s) == ("tokens", 5)


def test_without_limits_nothing_is_counted() -> None:
    limiter = Limiter(RateLimits())
    for _ in range(1000):
        limiter.admit("a")
        limiter.charge("a", images(64))
    assert limiter._callers == {}


def test_the_default_burst_is_a_minute_of_the_rate() -> None:
    limiter = Limiter(RateLimits(requests_per_minute=5), Clock())
    for _ in range(5):
        limiter.admit("a")
    with pytest.raises(RateLimited) as caught:
        limiter.admit("a")
    assert caught.value.retry_after_s == 12


def test_callers_with_full_buckets_are_forgotten_when_there_are_too_many() -> None:
    clock = Clock()
    limiter = Limiter(RateLimits(requests_per_minute=60, requests_burst=1), clock)  # one a second
    for i in range(MAX_CALLERS - 1):
        limiter.admit(f"earlier-{i}")
    clock.now += 1.0  # the earlier callers' buckets are full again
    limiter.admit("busy")
    assert len(limiter._callers) == MAX_CALLERS
    limiter.admit("new")
    assert set(limiter._callers) == {"busy", "new"}
    with pytest.raises(RateLimited):
        limiter.admit("busy")  # still remembered: its bucket is empty


def test_what_a_reply_generates() -> None:
    assert generated(text_pb2.TextResponse(token_ids=[1, 2, 3])) == (3, 0)
    assert generated(text_pb2.TextChunk(token_ids=[7])) == (1, 0)
    assert generated(images(4)) == (0, 4)
    assert generated(diffusion_pb2.DiffusionEvent(result=images(2))) == (0, 2)
    assert generated(diffusion_pb2.DiffusionEvent(progress=diffusion_pb2.DiffusionProgress(step=1))) == (0, 0)
    assert generated(text_pb2.TokenizeResponse(token_ids=[1, 2])) == (0, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [({"requests_per_minute": 0}, "requests_per_minute"), ({"tokens_burst": 5}, "tokens_burst: set tokens_per"),
     ({"images_per_minute": 1, "images_burst": 0}, "images_burst"), ({"request_per_minute": 1}, "request_per")],
)
def test_bad_limits_are_refused_naming_the_field(args: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RateLimits.model_validate(args)
