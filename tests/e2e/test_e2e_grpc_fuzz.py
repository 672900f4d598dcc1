"""Protocol fuzzing over gRPC (tests/e2e/grpc_fuzz.py): hypothesis requests over every field of every RPC of the
four services, against the session stack. No answer may be INTERNAL (or UNKNOWN), no status message may carry a
traceback or a file path, and no replica may be replaced.

`make test` sends a sample (GENSERVE_GRPC_FUZZ_PER_SERVICE per service, default 25); `make fuzz` sends at least
2,000 per service and prints the per-service table (GENSERVE_GRPC_FUZZ_REPORT also writes it to a file).
GENSERVE_GRPC_FUZZ_SEED draws another set of requests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.grpc_fuzz import APPLICATIONS, fuzz

pytestmark = pytest.mark.e2e

PER_SERVICE = int(os.environ.get("GENSERVE_GRPC_FUZZ_PER_SERVICE", "25"))
SEED = int(os.environ.get("GENSERVE_GRPC_FUZZ_SEED", "0"))
REPORT = os.environ.get("GENSERVE_GRPC_FUZZ_REPORT")


def test_no_fuzzed_request_gets_internal_leaks_or_restarts_a_replica(stack) -> None:
    run = fuzz(stack.address, PER_SERVICE, SEED, stack.pid)
    summary = f"{sum(t.sent for t in run.tallies.values())} requests in {run.seconds:.0f} s, seed {run.seed}"
    print(f"\n{run.table()}\n{summary}")
    if REPORT:
        Path(REPORT).parent.mkdir(parents=True, exist_ok=True)
        Path(REPORT).write_text(f"{run.table()}\n\n{summary}\n")
    assert set(run.tallies) == set(APPLICATIONS.values())
    assert not run.problems(), "\n".join(run.problems())
    for tally in run.tallies.values():
        assert tally.sent >= PER_SERVICE, tally
        assert tally.restarts == 0, tally
        # Both sides of validation are reached: some requests are refused, some run the model.
        assert tally.codes["INVALID_ARGUMENT"] > 0 and tally.codes["OK"] > 0, tally.codes
