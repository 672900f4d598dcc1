"""The OpenAI-compatible HTTP API on the real stack, driven by the official `openai` package (sync and async).

Every answer is checked against the same request over gRPC where one exists: the HTTP API must be the same
service, not a look-alike.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json

import jsonschema
import openai
import pytest
from PIL import Image

from genserve.services.client import Client

pytestmark = pytest.mark.e2e

CHAT = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def api(stack) -> openai.OpenAI:
    with openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def run_async(stack, work):
    """Run `work(client)` with an AsyncOpenAI client on a fresh event loop."""

    async def main():
        async with openai.AsyncOpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=60) as c:
            return await work(c)

    return asyncio.run(main())


def test_models_list_names_the_served_models(api: openai.OpenAI, client: Client) -> None:
    models = {m.id: m for m in api.models.list()}
    assert set(models) == {"text", "diffusion"}
    assert models["text"].owned_by == "genserve"
    assert models["text"].model_extra["root"] == client.model_info().model_name


def test_completion_is_the_grpc_generation(api: openai.OpenAI, client: Client) -> None:
    reply = api.completions.create(model="text", prompt="The with statement", max_tokens=8, temperature=0)
    grpc_reply = client.generate("The with statement", max_tokens=8, temperature=0)
    assert reply.object == "text_completion" and len(reply.choices) == 1
    assert reply.choices[0].text == grpc_reply.text
    assert reply.choices[0].finish_reason == ("length" if grpc_reply.finish_reason == "length" else "stop")
    assert reply.usage.prompt_tokens == len(client.tokenize("The with statement").token_ids)
    assert reply.usage.completion_tokens == len(grpc_reply.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_applies_the_template_and_counts_usage(api: openai.OpenAI, client: Client) -> None:
    reply = api.chat.completions.create(model="text", messages=CHAT, max_tokens=6, temperature=0)
    grpc_reply = client.generate(messages=CHAT, max_tokens=6, temperature=0)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == grpc_reply.text
    assert reply.usage.prompt_tokens == len(client.tokenize(messages=CHAT).token_ids) == grpc_reply.prompt_tokens
    assert reply.usage.completion_tokens == len(grpc_reply.token_ids)


def test_chat_n_and_seed(api: openai.OpenAI) -> None:
    kwargs = dict(model="text", messages=CHAT, max_tokens=8, temperature=1.0, seed=1234, n=2)
    first = api.chat.completions.create(**kwargs)
    again = api.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]  # same seed, same texts
    assert texts[0] != texts[1]  # choice j samples with seed + j
    assert first.usage.completion_tokens == again.usage.completion_tokens
    assert first.usage.prompt_tokens == api.chat.completions.create(**{**kwargs, "n": 1}).usage.prompt_tokens


def test_chat_stop_string_ends_the_answer(api: openai.OpenAI) -> None:
    full = api.chat.completions.create(model="text", messages=CHAT, max_tokens=16, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2:][:3]
    assert stop.strip(), text
    cut = api.chat.completions.create(model="text", messages=CHAT, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_chat_logprobs(api: openai.OpenAI) -> None:
    reply = api.chat.completions.create(model="text", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                        top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 2 and token.logprob <= 0
        assert token.top_logprobs[0].token == token.token  # greedy: the chosen token is the most likely
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-5)
        assert token.top_logprobs[1].logprob <= token.top_logprobs[0].logprob
        assert bytes(token.bytes).decode() == token.token


def test_chat_stream_sync_matches_unary_and_ends_with_usage(api: openai.OpenAI) -> None:
    unary = api.chat.completions.create(model="text", messages=CHAT, max_tokens=10, temperature=0)
    chunks = list(api.chat.completions.create(model="text", messages=CHAT, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == unary.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == unary.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_async_client_chat_stream_with_two_choices_and_completion(stack) -> None:
    async def work(c: openai.AsyncOpenAI):
        stream = await c.chat.completions.create(model="text", messages=CHAT, max_tokens=6, temperature=0.8,
                                                 seed=7, n=2, stream=True)
        texts = ["", ""]
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        unary = await c.chat.completions.create(model="text", messages=CHAT, max_tokens=6, temperature=0.8,
                                                seed=7, n=2)
        completion = await c.completions.create(model="text", prompt="def main", max_tokens=4, temperature=0)
        return texts, unary, completion

    texts, unary, completion = run_async(stack, work)
    assert texts == [choice.message.content for choice in unary.choices]
    assert completion.choices[0].text and completion.usage.completion_tokens >= 1


def test_response_format_json_schema_output_validates(api: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = api.chat.completions.create(
        model="text", messages=[{"role": "user", "content": "Give a person as JSON"}], max_tokens=64,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_images_generate_b64_pngs_of_the_model_size(api: openai.OpenAI, client: Client) -> None:
    reply = api.images.generate(model="diffusion", prompt="a large red circle at the top left", n=2,
                                size="32x32", response_format="b64_json", extra_body={"seed": 4, "steps": 2})
    pngs = [base64.b64decode(image.b64_json) for image in reply.data]
    assert len(pngs) == 2
    for png in pngs:
        with Image.open(io.BytesIO(png)) as img:
            assert img.format == "PNG" and img.size == (32, 32)
    grpc_reply = client.diffuse("a large red circle at the top left", steps=2, seed=4, num_images=2)
    assert pngs == [image.png for image in grpc_reply.images]


def test_images_async_with_extras(stack) -> None:
    async def work(c: openai.AsyncOpenAI):
        return await c.images.generate(prompt="a small blue square", extra_body={
            "seed": 5, "steps": 3, "negative_prompt": "red", "guidance_scale": 2.0, "scheduler": "dpmpp_2m"})

    reply = run_async(stack, work)
    assert len(reply.data) == 1
    with Image.open(io.BytesIO(base64.b64decode(reply.data[0].b64_json))) as img:
        assert img.size == (32, 32)
