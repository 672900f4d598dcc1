"""The one way a seed is drawn when a request or a call gives none: from the operating system's entropy
(``secrets``), never from torch's global generator, which a seeded caller (a test, a training run) makes repeat
itself. The drawn seed is reported back, so the result can be reproduced."""

from __future__ import annotations

import secrets

# Seeds are int64 on the wire (genserve.v1 protos) and in torch.Generator.manual_seed.
MAX_SEED = 2**63 - 1
# Fresh seeds stay below 2**31, so a client may pass any seed it was given back through a 32-bit field of its own.
FRESH_SEED_BOUND = 2**31


def resolve_seed(seed: int | None) -> int:
    """``seed``, or a fresh one when it is None."""
    return seed if seed is not None else secrets.randbelow(FRESH_SEED_BOUND)
