"""Which calls the SDK retries, and how: a gRPC service-config retry policy (gRFC A6) on a channel of their own.

Only calls whose answer does not depend on when or how often they run are retried, with exponential backoff, and only
after UNAVAILABLE (no server took the call: a server draining, a connection refused) or INTERNAL, which is how Ray
Serve's gRPC proxy reports a replica that died in the middle of the call ("The actor died unexpectedly"; the retry
reaches another replica, or the restarted one). A genuine server error repeats as itself, a second or so later:
- GetModelInfo, Tokenize, VAE Decode and Reconstruct, GAN Interpolate, health Check and GetStatus: always;
- GAN Sample and VAE Encode: when the request carries a seed (an unseeded one draws fresh noise each time; an Encode
  without `sample` is the posterior mean, also the same every time).
Everything else, and every stream, goes through a channel with retries off: a second run of Generate would draw
other tokens, and a stream may already have delivered part of its answer.
"""

from __future__ import annotations

import json
from typing import Any

# gRPC service name -> its idempotent methods (names from protos/genserve/v1/*.proto and grpc.health.v1).
IDEMPOTENT = {
    "genserve.v1.TextGeneration": ("GetModelInfo", "Tokenize"),
    "genserve.v1.ImageGan": ("Sample", "Interpolate"),
    "genserve.v1.Vae": ("Encode", "Decode", "Reconstruct"),
    "genserve.v1.ServeStatus": ("GetStatus",),
    "grpc.health.v1.Health": ("Check",),
}
# Five attempts is gRPC's ceiling. Each wait is drawn from [0, backoff] with the backoff doubling from 0.1 s, so all
# retries take at most 1.5 s: a client with no server still hears "failed to connect" within a 2 s deadline, and a
# call cut off by a dying replica is meanwhile routed to a live one (Serve queues it while none is up). Throttling
# stops retrying when most calls fail, so a dead server is not hammered.
RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE", "INTERNAL"],
}
RETRY_THROTTLING = {"maxTokens": 10, "tokenRatio": 0.5}


def service_config() -> dict[str, Any]:
    names = [{"service": service, "method": method} for service, methods in IDEMPOTENT.items() for method in methods]
    return {"methodConfig": [{"name": names, "retryPolicy": RETRY_POLICY}], "retryThrottling": RETRY_THROTTLING}


def channel_options(*, retrying: bool) -> list[tuple[str, Any]]:
    """Options for the retrying channel (with the policy) or the plain one (retries off, transparent ones too)."""
    if not retrying:
        return [("grpc.enable_retries", 0)]
    return [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(service_config()))]


def seeded(request: Any) -> bool:
    """A GanSampleRequest or EncodeRequest whose answer is fixed: a seed is given (or, for Encode, no sampling)."""
    return request.HasField("seed") or getattr(request, "sample", True) is False
