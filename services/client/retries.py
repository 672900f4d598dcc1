"""Which calls the SDK retries, and how.

Only calls whose answer does not depend on when or how often they run are retried:
- GetModelInfo, Tokenize, VAE Decode and Reconstruct, GAN Interpolate, health Check and GetStatus: always;
- GAN Sample and VAE Encode: when the request carries a seed (or, for Encode, asks for no sampling: the posterior
  mean). An unseeded one draws fresh noise each time.
Generate and every stream are never retried: a second Generate would draw other tokens, and a stream may already
have delivered part of its answer.

They are retried after UNAVAILABLE (a draining server, a refused connection, an app with no replica yet), and after
the INTERNAL with which Ray Serve's gRPC proxy reports a replica that died in the middle of the call ("The actor
died unexpectedly ..." over Ray actor calls, "The actor ... is unavailable: Actor is unavailable." when the proxy
reaches replicas over gRPC; the retry reaches another replica, or waits in the proxy for the restarted one). Any
other INTERNAL is a server error and comes back at once.

Why a loop in the SDK and not gRPC's service-config retry policy (gRFC A6): gRPC retries only a call that is not yet
committed, and a call commits when response headers arrive. Ray Serve's proxy answers every call, failed ones
included, with headers, a message and then the status, so a service-config policy would retry nothing but
connection failures.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

# What Ray puts in the details when the replica's actor died (RayActorError / ActorDiedError / ActorUnavailableError).
REPLICA_DIED = ("actor died", "actordiederror", "actorunavailableerror", "actor is unavailable")


def retryable(error: grpc.RpcError) -> bool:
    code = error.code() if hasattr(error, "code") else None
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    details = ((error.details() if hasattr(error, "details") else None) or "").lower()
    return code == grpc.StatusCode.INTERNAL and any(marker in details for marker in REPLICA_DIED)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter: the n-th retry waits backoff(n) drawn from [b/2, b], b = initial × multiplier^n
    capped at max. The defaults wait about 4 to 8 s over 5 retries: a replica's restart takes a few seconds."""

    max_attempts: int = 6
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 4.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts: must be >= 1")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("initial_backoff_s: must be > 0 and <= max_backoff_s")

    def backoff(self, retry: int, draw: Callable[[], float] = random.random) -> float:
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**retry)
        return ceiling * (0.5 + 0.5 * draw())

    def delay(self, error: grpc.RpcError, attempt: int, deadline: float | None,
              draw: Callable[[], float] = random.random) -> float | None:
        """Seconds to wait before attempt `attempt + 1` after `error`, or None: not retryable, out of attempts, or the
        wait would run past the call's deadline (then the caller sees this error, not DEADLINE_EXCEEDED)."""
        if not retryable(error) or attempt + 1 >= self.max_attempts:
            return None
        wait = self.backoff(attempt, draw)
        if deadline is not None and time.monotonic() + wait >= deadline:
            return None
        return wait


DEFAULT_RETRY = RetryPolicy()


def seeded(request: Any) -> bool:
    """A GanSampleRequest or EncodeRequest whose answer is fixed: a seed is given (or, for Encode, no sampling)."""
    return request.HasField("seed") or getattr(request, "sample", True) is False


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
