"""Rate limits per caller: token buckets for requests, generated tokens and images (docs/security.md).

A caller is an API key (per peer host when no keys are configured; services/common/auth.py). Each limit is a token
bucket (Turner's "token bucket" policer, as in RFC 2697): it holds at most `burst` and refills at `per_minute / 60`
a second. A request takes one from the requests bucket. Tokens and images are counted as they are generated, so a
request is admitted while the caller's tokens/images buckets are not empty, and what it generates is then taken out,
which may leave a bucket below zero (a debt); later requests wait until it has refilled to one. A refused call gets
RESOURCE_EXHAUSTED (HTTP 429) and the seconds until it would be admitted.

The buckets live in one replica's memory: with N replicas of an app a caller may get up to N times the limit, and a
restarted replica starts with full buckets. Everything here runs on the replica's event loop, never concurrently.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import Message
from pydantic import BaseModel, ConfigDict, Field, model_validator

from genserve.v1 import common_pb2, diffusion_pb2, text_pb2

from .errors import RateLimited

# Callers whose buckets are all full again are forgotten (a fresh entry is identical) once there are this many.
MAX_CALLERS = 10_000


class RateLimits(BaseModel):
    """The serve config's `rate_limits` arg of an app; a limit left out (None) is off."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    requests_per_minute: float | None = Field(None, gt=0)
    requests_burst: int | None = Field(None, ge=1)  # the bucket's size; default: one minute's worth
    tokens_per_minute: float | None = Field(None, gt=0)  # generated text tokens
    tokens_burst: int | None = Field(None, ge=1)
    images_per_minute: float | None = Field(None, gt=0)  # images returned (gan, vae Decode/Reconstruct, diffusion)
    images_burst: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _burst_needs_a_rate(self) -> RateLimits:
        for what in ("requests", "tokens", "images"):
            if getattr(self, f"{what}_burst") is not None and getattr(self, f"{what}_per_minute") is None:
                raise ValueError(f"{what}_burst: set {what}_per_minute too")
        return self

    @property
    def off(self) -> bool:
        return all(getattr(self, f"{what}_per_minute") is None for what in ("requests", "tokens", "images"))


@dataclass
class TokenBucket:
    """`level` of at most `capacity`, refilled at `rate` per second since `stamp`."""

    rate: float
    capacity: float
    level: float
    stamp: float

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait(self, now: float, need: float = 1.0) -> float:
        """Seconds until the bucket holds `need` (0 when it does now)."""
        self._refill(now)
        return max(0.0, (need - self.level) / self.rate)

    def take(self, now: float, amount: float) -> None:
        self._refill(now)
        self.level -= amount

    def full(self, now: float) -> bool:
        self._refill(now)
        return self.level >= self.capacity


def generated(message: Message) -> tuple[int, int]:
    """(tokens, images) a reply hands the client: a text reply's or chunk's token ids, an ImagesResponse's images,
    a diffusion stream's final result (previews are free)."""
    if isinstance(message, text_pb2.TextResponse | text_pb2.TextChunk):
        return len(message.token_ids), 0
    if isinstance(message, common_pb2.ImagesResponse):
        return 0, len(message.images)
    if isinstance(message, diffusion_pb2.DiffusionEvent) and message.HasField("result"):
        return 0, len(message.result.images)
    return 0, 0


class Limiter:
    """The buckets of every caller seen by this replica, under one `RateLimits`."""

    def __init__(self, limits: RateLimits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.clock = clock
        self._callers: dict[str, dict[str, TokenBucket]] = {}

    def _new_buckets(self, now: float) -> dict[str, TokenBucket]:
        buckets = {}
        for what in ("requests", "tokens", "images"):
            per_minute = getattr(self.limits, f"{what}_per_minute")
            if per_minute is not None:
                capacity = getattr(self.limits, f"{what}_burst") or max(1.0, per_minute)
                buckets[what] = TokenBucket(per_minute / 60.0, capacity, capacity, now)
        return buckets

    def _buckets(self, caller: str, now: float) -> dict[str, TokenBucket]:
        if caller not in self._callers:
            if len(self._callers) >= MAX_CALLERS:
                self._forget_full(now)
            self._callers[caller] = self._new_buckets(now)
        return self._callers[caller]

    def _forget_full(self, now: float) -> None:
        for caller in [c for c, buckets in self._callers.items() if all(b.full(now) for b in buckets.values())]:
            del self._callers[caller]

    def admit(self, caller: str) -> None:
        """Take one request from `caller`'s bucket, or raise RateLimited with the wait of the emptiest bucket."""
        if self.limits.off:
            return
        now = self.clock()
        buckets = self._buckets(caller, now)
        waits = {what: bucket.wait(now) for what, bucket in buckets.items()}
        what, longest = max(waits.items(), key=lambda item: item[1])
        if longest > 0:
            raise RateLimited(what, max(1, math.ceil(longest)))
        if "requests" in buckets:
            buckets["requests"].take(now, 1)

    def charge(self, caller: str, message: Message) -> None:
        """Take what `message` hands the caller out of its tokens/images buckets."""
        if self.limits.off:
            return
        tokens, images = generated(message)
        if not tokens and not images:
            return
        now = self.clock()
        buckets = self._buckets(caller, now)
        for what, amount in (("tokens", tokens), ("images", images)):
            if amount and what in buckets:
                buckets[what].take(now, amount)
