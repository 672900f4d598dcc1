"""The HTTP API's pieces without a stack: OpenAI bodies -> TextRequest / DiffusionRequest (validated against the
gRPC schemas), replies -> OpenAI objects, errors -> OpenAI error objects, the body limit and stream merging."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.responses import PlainTextResponse
from pydantic import ValidationError
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError
from starlette.testclient import TestClient

from genserve.services.common.errors import InvalidArgument
from genserve.services.http import images, text
from genserve.services.http.app import TEXT_ERRORS, BodyLimit, _field_loc
from genserve.services.http.errors import describe, rename
from genserve.services.http.schemas import ChatBody, CompletionBody, ImageBody
from genserve.services.http.streams import batches, merge
from genserve.services.text.engine.params import PromptTooLong
from genserve.shared.seeds import MAX_SEED
from genserve.v1 import common_pb2, text_pb2

CHAT = {"model": "text", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields) -> ChatBody:
    return ChatBody.model_validate({**CHAT, **fields})


def test_chat_body_maps_onto_text_requests_one_per_choice() -> None:
    job = text.chat_job(chat(n=3, seed=10, max_completion_tokens=7, temperature=0.5, stop="END",
                             messages=[{"role": "developer", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}]))
    assert len(job.requests) == 3 and job.n == 3 and job.top_logprobs is None
    assert [r.seed for r in job.requests] == [10, 11, 12]
    first = job.requests[0]
    assert [(m.role, m.content) for m in first.messages] == [("system", "be brief"), ("user", "ab")]
    assert first.max_tokens == 7 and first.temperature == 0.5 and list(first.stop) == ["END"]
    assert not first.HasField("top_p") and not first.HasField("logprobs")  # unset: TextIn's defaults apply


def test_seeds_wrap_inside_int64() -> None:
    job = text.completion_job(CompletionBody(model="text", prompt="x", n=2, seed=MAX_SEED))
    assert [r.seed for r in job.requests] == [MAX_SEED, 0]


def test_logprobs_need_one_alternative_from_the_engine_even_for_zero() -> None:
    job = text.chat_job(chat(logprobs=True))
    assert job.requests[0].logprobs == 1 and job.top_logprobs == 0
    job = text.chat_job(chat(logprobs=True, top_logprobs=3))
    assert job.requests[0].logprobs == 3 and job.top_logprobs == 3
    with pytest.raises(InvalidArgument, match="top_logprobs"):
        text.chat_job(chat(top_logprobs=2))


def test_limits_are_the_grpc_handlers() -> None:
    with pytest.raises(ValidationError) as error:
        text.chat_job(chat(max_tokens=5000))
    assert error.value.errors()[0]["loc"] == ("max_tokens",)
    with pytest.raises(ValidationError):
        text.completion_job(CompletionBody(model="text", prompt="x", stop=["a", "b", "c", "d", "e"]))


def test_completion_prompts_times_n_are_bounded() -> None:
    job = text.completion_job(CompletionBody(model="text", prompt=["a", "b"], n=2))
    assert [r.prompt for r in job.requests] == ["a", "a", "b", "b"]
    with pytest.raises(InvalidArgument, match="^n:"):
        text.completion_job(CompletionBody(model="text", prompt=["a", "b", "c"], n=3))


def test_response_format_becomes_json_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    job = text.chat_job(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert json.loads(job.requests[0].json_schema) == schema
    assert json.loads(text.chat_job(chat(response_format={"type": "json_object"})).requests[0].json_schema) == {
        "type": "object"}
    assert text.chat_job(chat(response_format={"type": "text"})).requests[0].json_schema == ""
    with pytest.raises(InvalidArgument, match="response_format.json_schema"):
        text.chat_job(chat(response_format={"type": "json_schema"}))


def test_bodies_are_strictly_typed_and_ignore_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        chat(temperature="0.5")
    with pytest.raises(ValidationError):
        chat(max_tokens=2.0)
    assert chat(temperature=1, logit_bias={"1": 2}).temperature == 1.0


def test_chat_reply_with_logprobs_and_usage() -> None:
    job = text.chat_job(chat(n=2, logprobs=True, top_logprobs=1))
    lp = text_pb2.TokenLogprob(token_id=5, logprob=-0.5, top=[text_pb2.TopLogprob(token_id=5, logprob=-0.5),
                                                             text_pb2.TopLogprob(token_id=6, logprob=-1.5)])
    replies = [text_pb2.TextResponse(text="hé", token_ids=[5], finish_reason="eos", prompt_tokens=9, logprobs=[lp]),
               text_pb2.TextResponse(text="hé", token_ids=[5, 5], finish_reason="length", prompt_tokens=9)]
    reply = text.chat_reply("text", job, replies, {5: "hé", 6: "x"})
    assert reply["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    assert [c["finish_reason"] for c in reply["choices"]] == ["stop", "length"]
    (token,) = reply["choices"][0]["logprobs"]["content"]
    assert token == {"token": "hé", "logprob": -0.5, "bytes": [104, 195, 169],
                     "top_logprobs": [{"token": "hé", "logprob": -0.5, "bytes": [104, 195, 169]}]}


def test_completion_stream_chunks_offsets_and_usage() -> None:
    job = text.completion_job(CompletionBody(model="text", prompt="p", logprobs=0))
    writer = text.ChunkWriter(False, "text", job, include_usage=True)
    assert writer.roles() == []
    texts = {1: "ab", 2: "c"}
    first = writer.chunk(0, text_pb2.TextChunk(text="ab", token_ids=[1], logprobs=[
        text_pb2.TokenLogprob(token_id=1, logprob=-1.0, top=[text_pb2.TopLogprob(token_id=1, logprob=-1.0)])]), texts)
    last = writer.chunk(0, text_pb2.TextChunk(text="c", token_ids=[2], finish_reason="stop", prompt_tokens=4, logprobs=[
        text_pb2.TokenLogprob(token_id=2, logprob=-2.0)]), texts)
    assert first["choices"][0]["logprobs"] == {"tokens": ["ab"], "token_logprobs": [-1.0], "top_logprobs": [{}],
                                               "text_offset": [0]}
    assert last["choices"][0]["logprobs"]["text_offset"] == [2] and last["choices"][0]["finish_reason"] == "stop"
    assert first["usage"] is None and first["id"] == last["id"]
    assert writer.usage_chunk()["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    assert text.sse("[DONE]") == b"data: [DONE]\n\n"


def test_image_body_maps_onto_a_diffusion_request() -> None:
    request = images.diffusion_request(ImageBody(prompt="a red circle", n=2, size="32x32", seed=3, steps=4,
                                                 scheduler="ddpm"), (32, 32))
    assert (request.prompt, request.num_images, request.seed, request.steps, request.scheduler) == (
        "a red circle", 2, 3, 4, "ddpm")
    assert not request.HasField("guidance_scale")
    with pytest.raises(InvalidArgument, match="allowed sizes: 32x32"):
        images.diffusion_request(ImageBody(prompt="x", size="64x64"), (32, 32))
    with pytest.raises(InvalidArgument, match="response_format"):
        images.diffusion_request(ImageBody(prompt="x", response_format="url"), (32, 32))
    with pytest.raises(ValidationError):
        images.diffusion_request(ImageBody(prompt="x", n=9), (32, 32))
    guided = images.diffusion_request(ImageBody(prompt="x", negative_prompt="a green circle", guidance="perp_neg",
                                                negative_weight=0.25), (32, 32))
    assert (guided.guidance, guided.negative_weight, guided.negative_prompt) == ("perp_neg", 0.25, "a green circle")
    assert not request.HasField("negative_weight") and request.guidance == ""
    with pytest.raises(ValidationError, match="guidance"):
        images.diffusion_request(ImageBody(prompt="x", guidance="plain"), (32, 32))
    reply = images.images_reply(common_pb2.ImagesResponse(images=[common_pb2.Image(png=b"\x89PNG")]))
    assert reply["data"] == [{"b64_json": "iVBORw=="}]


def test_errors_name_the_field_as_the_body_spells_it() -> None:
    assert rename("logprobs", {"logprobs": "top_logprobs"}) == "top_logprobs"
    assert rename("messages[2].content", {}) == "messages[2].content"
    with pytest.raises(ValidationError) as error:
        text.chat_job(chat(logprobs=True, top_logprobs=9))
    status, body = describe(error.value, "rid", {"logprobs": "top_logprobs"})
    assert status == 400 and body["error"]["param"] == "top_logprobs"
    assert body["error"]["message"].startswith("top_logprobs: ")
    status, body = describe(PromptTooLong("13 tokens leave no room"), "rid", {}, TEXT_ERRORS)
    assert status == 400 and body["error"]["param"] == "prompt"


def test_overload_internal_and_wrapped_errors() -> None:
    status, body = describe(BackPressureError(num_queued_requests=8, max_queued_requests=8), "rid")
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    status, body = describe(KeyError("/secret/path.py"), "rid-7")
    assert status == 500 and body["error"]["message"] == "internal error (request id rid-7)"
    wrapped = RayTaskError("fn", "Traceback ... /work/x.py", InvalidArgument("prompt", "bad"))
    status, body = describe(wrapped, "rid")
    assert status == 400 and body["error"]["message"] == "prompt: bad" and body["error"]["param"] == "prompt"


def test_union_tags_are_not_fields() -> None:
    assert _field_loc(("prompt", "str")) == ("prompt",)
    assert _field_loc(("messages", 0, "content", "list[TextPart]", 1, "text")) == ("messages", 0, "content", 1,
                                                                                     "text")


def test_body_limit_refuses_large_and_chunked_bodies_and_replays_small_ones() -> None:
    async def echo(scope, receive, send):
        message = await receive()
        await PlainTextResponse(str(len(message["body"])))(scope, receive, send)

    client = TestClient(BodyLimit(echo, limit=100))  # no `with`: no lifespan events for this bare app
    assert client.post("/", content=b"x" * 100).text == "100"
    big = client.post("/", content=b"x" * 101)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    chunked = client.post("/", content=iter([b"x" * 60, b"x" * 60]))
    assert chunked.status_code == 413


def test_merge_interleaves_and_forwards_errors() -> None:
    async def numbers(start: int, fail: bool = False):
        for i in range(start, start + 3):
            await asyncio.sleep(0.001)
            yield i
        if fail:
            raise ValueError("boom")

    async def collect(streams):
        return [item async for item in merge(streams)]

    items = asyncio.run(collect([numbers(0), numbers(10)]))
    assert sorted(items) == [(0, 0), (0, 1), (0, 2), (1, 10), (1, 11), (1, 12)]
    with pytest.raises(ValueError, match="boom"):
        asyncio.run(collect([numbers(0), numbers(10, fail=True)]))


def test_batches_hand_over_what_arrived_while_the_writer_was_busy_and_never_wait_for_more() -> None:
    async def burst(fail: bool = False):
        yield 1
        await asyncio.sleep(0.05)  # the writer gets 1 alone: nothing else has arrived
        for i in (2, 3, 4):  # these three arrive while the writer is busy
            yield i
        await asyncio.sleep(0.05)
        yield 5
        if fail:
            raise ValueError("boom")

    async def collect(fail: bool = False):
        out = []
        try:
            async for group in batches(burst(fail)):
                out.append(group)
                await asyncio.sleep(0.02)  # a slow writer
        except ValueError as exc:
            out.append(str(exc))
        return out

    assert asyncio.run(collect()) == [[1], [2, 3, 4], [5]]
    assert asyncio.run(collect(fail=True)) == [[1], [2, 3, 4], [5], "boom"]


def test_the_speculative_opt_out_reaches_the_sampling_params() -> None:
    """genserve's `speculative: false` (extra_body) -> TextRequest.speculative -> SamplingParams.speculative; unset, the
    request may be drafted for."""
    from genserve.services.common.validation import parse
    from genserve.services.text.schema import TextIn

    off, default = text.chat_job(chat(speculative=False)).requests[0], text.chat_job(chat()).requests[0]
    assert off.HasField("speculative") and not off.speculative and not default.HasField("speculative")
    assert parse(TextIn, off).sampling_params(64).speculative is False
    assert parse(TextIn, default).sampling_params(64).speculative is True
    with pytest.raises(ValidationError, match="speculative"):
        chat(speculative="sometimes")
