"""Fuzzing the HTTP API with schemathesis, from the OpenAPI schema the service itself publishes: no generated
request (valid or not) may get a 5xx.

`make test` sends a small sample (GENSERVE_FUZZ_EXAMPLES per operation, default 8); `make fuzz-http` sends at
least 500. Work a request may ask for is capped inside the limits (at most 4 tokens, 2 choices, 2 images of 2
steps), so the run takes seconds per hundred requests; values outside the limits are sent as generated.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

pytestmark = pytest.mark.e2e

EXAMPLES = int(os.environ.get("GENSERVE_FUZZ_EXAMPLES", "8"))
# body field -> the most work a fuzzed request may ask for, applied only to values the API would accept.
CAPS = {"max_tokens": (1, 1024, 4), "max_completion_tokens": (1, 1024, 4), "n": (1, 8, 2), "steps": (1, 200, 2)}
SENT: list[int] = []


@pytest.fixture(scope="module")
def http_schema(stack) -> Any:
    return schemathesis.openapi.from_url(f"http://127.0.0.1:{stack.http_port}/openapi.json")


schema = schemathesis.pytest.from_fixture("http_schema")


def cap(body: Any) -> None:
    if not isinstance(body, dict):
        return
    for field, (low, high, most) in CAPS.items():
        value = body.get(field)
        if type(value) is int and most < value <= high and value >= low:
            body[field] = most


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
          database=None)
def test_no_generated_request_gets_a_server_error(case: schemathesis.Case) -> None:
    cap(case.body)
    response = case.call(timeout=120)
    SENT.append(response.status_code)
    case.validate_response(response, checks=[not_a_server_error])


def test_the_sample_was_sent() -> None:
    """Every operation got its examples (GET /v1/models has no input: one), and none was a 5xx."""
    assert len(SENT) >= 3 * EXAMPLES, SENT
    assert all(status < 500 for status in SENT)
