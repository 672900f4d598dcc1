"""Structured outputs and prefix caching through the Serve proxy: sampled JSON Schema / regex streams running
concurrently with unconstrained ones, and prefix-cache hits reported by GetModelInfo."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from genserve.services.client import Client

pytestmark = pytest.mark.e2e

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 10},
        "kind": {"enum": ["book", "film", "song"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10}, "maxItems": 3},
        "author": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}, "alive": {"type": "boolean"}},
            "required": ["name", "alive"],
            "additionalProperties": False,
        },
    },
    "required": ["title", "kind", "scores", "author"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{1,2} [a-z]{2,4}"


def streamed(client: Client, prompt: str, **options) -> tuple[str, str, int]:
    """(text, finish_reason, chunk count) of one GenerateStream call."""
    chunks = list(client.generate_stream(prompt, **options))
    return "".join(c.text for c in chunks), chunks[-1].finish_reason, len(chunks)


def test_structured_streams_in_one_batch_with_unconstrained_ones(client: Client) -> None:
    schema = json.dumps(SCHEMA)
    calls = [dict(json_schema=schema, seed=s) for s in range(8)] + [dict(regex=REGEX, seed=s) for s in range(4)]
    calls += [dict(seed=100 + s, max_tokens=32) for s in range(4)]  # unconstrained, in the same batch
    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda o: streamed(client, "Answer:", temperature=1.0,
                                                   **{"max_tokens": 150, **o}), calls))
    for text, reason, n_chunks in results[:8]:
        assert reason == "stop" and n_chunks > 3, text
        jsonschema.validate(json.loads(text), SCHEMA)
    for text, reason, _ in results[8:12]:
        assert reason == "stop" and re.fullmatch(REGEX, text), text
    for (text, reason, _), options in zip(results[12:], calls[12:], strict=True):
        alone = client.generate("Answer:", temperature=1.0, **options)
        assert (text, reason) == (alone.text, alone.finish_reason)


def test_prefix_cache_hits_are_reported(client: Client) -> None:
    before = client.model_info()
    assert before.prefix_caching
    system = "You are a careful assistant who answers in one short sentence. " * 8
    for question in ("Why?", "How?"):
        client.generate(system + question, max_tokens=2, temperature=0)
    after = client.model_info()
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens >= after.block_size
