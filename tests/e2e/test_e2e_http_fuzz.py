"""Fuzzing the HTTP API with schemathesis, from the OpenAPI schema the service itself publishes: no generated
request, valid (positive) or not (negative), may get a 5xx.

`make test` sends a small sample (GENSERVE_FUZZ_EXAMPLES per operation and mode, default 6); `make fuzz-http`
sends at least 500. The work a request may ask for is capped inside the limits (at most 4 tokens, 2 choices,
2 images of 2 steps) so a hundred requests take seconds; values outside the limits are sent as generated.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

pytestmark = pytest.mark.e2e

EXAMPLES = int(os.environ.get("GENSERVE_FUZZ_EXAMPLES", "6"))
# At least this many requests in all (make fuzz-http sets it to 500).
MIN_REQUESTS = int(os.environ.get("GENSERVE_FUZZ_MIN_REQUESTS", str(6 * EXAMPLES)))
# body field -> (low, high, most): a value the API would take (low..high) is lowered to `most`.
CAPS = {"max_tokens": (1, 1024, 4), "max_completion_tokens": (1, 1024, 4), "max_output_tokens": (1, 1024, 4),
        "n": (1, 8, 2), "steps": (1, 200, 2)}


def cap(body: Any) -> None:
    if not isinstance(body, dict):
        return
    for field, (low, high, most) in CAPS.items():
        value = body.get(field)
        if type(value) is int and low <= value <= high and value > most:
            body[field] = most


def fuzz(operation: schemathesis.APIOperation, mode: GenerationMode, base_url: str) -> list[int]:
    """Send EXAMPLES generated requests for `operation`; each must pass not_a_server_error. Their statuses."""
    statuses: list[int] = []

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        cap(case.body)
        response = case.call(base_url=base_url, timeout=120)
        statuses.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])

    run()
    return statuses


def test_no_generated_request_gets_a_server_error(stack) -> None:
    base_url = f"http://127.0.0.1:{stack.http_port}"
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    statuses: dict[str, list[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if operation.body else (GenerationMode.POSITIVE,)
        for mode in modes:
            statuses[f"{operation.label} {mode.value}"] = fuzz(operation, mode, base_url)
    sent = [s for codes in statuses.values() for s in codes]
    assert {label.split(" ")[1] for label in statuses} == {
        "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/images/generations", "/v1/images/edits",
        "/v1/responses", "/v1/responses/{response_id}", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    assert len(sent) >= MIN_REQUESTS, {k: len(v) for k, v in statuses.items()}
    assert all(code < 500 for code in sent)
    # Positive requests mostly reach the models: not everything may come back as 4xx. The admin routes are left out:
    # this stack has no `lora` serve config, so every load and unload there is refused with a 400.
    positive = [s for label, codes in statuses.items()
                if label.endswith("positive") and "lora_adapter" not in label for s in codes]
    assert sum(code == 200 for code in positive) >= len(positive) // 4, statuses
