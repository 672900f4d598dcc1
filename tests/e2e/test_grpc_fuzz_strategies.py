"""The gRPC fuzzer's requests (no stack): every RPC of the four services is fuzzed, every field of every request
is set by some generated request, extremes and hostile images come up, and a huge request stays bounded."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import replace

import pytest
from google.protobuf import empty_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis import strategies as st
from PIL import Image

from genserve.v1 import common_pb2
from tests.e2e.grpc_fuzz import EMPTY_REQUEST_CALLS, LEAK, PROTO_MODULES, Outcome, generate, requests_for, rpcs
from tests.e2e.grpc_fuzz_strategies import (
    FLOAT32_MAX,
    HUGE_BYTES,
    INT64,
    field_names,
    floats,
    image_bytes,
    integers,
    png_claiming,
    repeated,
    request_strategy,
    texts,
)

EXAMPLES = 100


def set_paths(message: Message, prefix: str = "") -> set[str]:
    """Field paths set in `message`, recursing into (repeated) sub-messages: the first few items of a list, as a huge
    one repeats one element (grpc_fuzz_strategies.repeated)."""
    paths = set()
    for field, value in message.ListFields():
        path = prefix + field.name
        paths.add(path)
        if field.type == FieldDescriptor.TYPE_MESSAGE and not field.message_type.GetOptions().map_entry:
            for item in value[:8] if field.is_repeated else [value]:
                paths |= set_paths(item, path + ".")
    return paths


def test_every_rpc_of_the_four_services_is_fuzzed() -> None:
    expected = {f"{s.name}/{m.name}" for module in PROTO_MODULES for s in module.DESCRIPTOR.services_by_name.values()
                for m in s.methods}
    assert {rpc.name for rpc in rpcs()} == expected
    assert {"TextGeneration/Tokenize", "Vae/Decode", "Diffusion/GenerateStream", "ImageGan/Interpolate"} <= expected
    assert {rpc.name for rpc in rpcs() if rpc.streaming} == {"TextGeneration/GenerateStream",
                                                              "Diffusion/GenerateStream"}


def test_a_service_gets_its_share_of_distinct_requests() -> None:
    text = [r for r in rpcs() if r.app == "text"]
    plan = requests_for(text, 60, seed_value=0)
    assert len(plan) >= 60 and {rpc.name for rpc, _ in plan} == {r.name for r in text}
    fuzzed = [(rpc.name, request.SerializeToString()) for rpc, request in plan]
    assert len(set(fuzzed)) == len(fuzzed)


def test_an_rpc_whose_request_has_no_fields_is_called_a_fixed_number_of_times() -> None:
    # every genserve request has fields today (GetModelInfo gained `model`); a fieldless one gets no fuzzed share
    info = next(r for r in rpcs() if r.name == "TextGeneration/GetModelInfo")
    fieldless = replace(info, method="Ping", request=empty_pb2.Empty)
    plan = requests_for([fieldless, info], 10, seed_value=0)
    assert [request for rpc, request in plan if rpc is fieldless] == [empty_pb2.Empty()] * EMPTY_REQUEST_CALLS
    assert sum(rpc is info for rpc, _ in plan) == 10 - EMPTY_REQUEST_CALLS


# One RPC per request type: a stream and its unary twin draw from the same strategy.
FIELDED = list({r.request.DESCRIPTOR.full_name: r for r in rpcs() if r.request.DESCRIPTOR.fields}.values())


@pytest.mark.parametrize("rpc", FIELDED, ids=lambda r: r.request.DESCRIPTOR.full_name)
def test_every_field_is_set_by_some_request(rpc) -> None:
    drawn = generate(rpc, EXAMPLES, seed_value=0)
    covered = set().union(*(set_paths(m) for m in drawn))
    assert set(field_names(rpc.request.DESCRIPTOR)) <= covered


def first_request(rpc, condition: Callable[[Message], bool]) -> Message:
    """The first request hypothesis draws for `rpc` that meets `condition` (no shrinking: a search, not a proof)."""
    return find(request_strategy(rpc.request), condition,
                settings=settings(max_examples=3000, database=None, derandomize=True, phases=[Phase.generate],
                                  suppress_health_check=list(HealthCheck)))


def floats_of(message: Message) -> list[float]:
    return [v for field, v in message.ListFields() if field.type == FieldDescriptor.TYPE_FLOAT]


def test_numbers_reach_their_extremes() -> None:
    assert math.isnan(find(floats(32), math.isnan)) and find(floats(32), math.isinf)
    assert find(floats(32), lambda x: x == FLOAT32_MAX) and find(integers(*INT64), lambda x: x == -(2**63))
    # Each extreme is searched for in whole requests, as the fuzzer draws them, and found in the first few hundred.
    rpc = next(r for r in rpcs() if r.name == "TextGeneration/Generate")
    assert any(math.isnan(x) for x in floats_of(first_request(rpc, lambda m: any(map(math.isnan, floats_of(m))))))
    assert any(abs(x) > 1e30 for x in floats_of(first_request(rpc, lambda m: any(abs(x) > 1e30 for x in floats_of(m)))))
    assert first_request(rpc, lambda m: m.HasField("seed") and m.seed < 0).seed < 0
    empty = first_request(rpc, lambda m: len(m.messages) == 0 and m.prompt == "")  # empty ones
    assert len(empty.messages) == 0 and empty.prompt == ""
    assert len(find(texts(), lambda text: len(text) >= 3_000_000)) >= 3_000_000  # huge strings
    assert len(find(repeated(st.just("x")), lambda items: len(items) >= 100_000)) == 100_000  # huge repeated


def test_images_are_real_broken_and_hostile() -> None:
    rpc = next(r for r in rpcs() if r.name == "Vae/Encode")
    pngs = [image.png for m in generate(rpc, 300, seed_value=2) for image in m.images]
    readable, unreadable = 0, 0
    for data in set(pngs):
        try:
            with Image.open(io.BytesIO(data)) as img:
                img.load()
            readable += 1
        except Exception:
            unreadable += 1
    assert readable > 10 and unreadable > 10
    assert find(image_bytes(), lambda data: data.startswith(b"%!PS"))  # PIL would hand EPS to Ghostscript


def test_a_claimed_size_header_reads_as_that_size() -> None:
    with Image.open(io.BytesIO(png_claiming(100_000, 3))) as img:
        assert img.size == (100_000, 3)


def test_latents_come_in_served_and_broken_shapes() -> None:
    rpc = next(r for r in rpcs() if r.name == "Vae/Decode")
    latents: list[common_pb2.Tensor] = [m.latents for m in generate(rpc, 300, seed_value=3) if m.HasField("latents")]
    served = [t for t in latents if list(t.shape[1:]) == [4, 8, 8] and len(t.data) == math.prod(t.shape) * 4]
    assert served and any(list(t.shape[1:]) != [4, 8, 8] for t in latents)
    dtypes = {t.dtype for t in latents}
    assert dtypes >= {"", "float32", "float16", "bfloat16"} and dtypes - {"", "float32", "float16", "bfloat16"}


def test_huge_requests_stay_bounded() -> None:
    for rpc in FIELDED:
        for message in generate(rpc, 30, seed_value=4):
            assert message.ByteSize() < 4 * HUGE_BYTES, rpc.name


def test_a_traceback_or_path_in_a_status_message_is_caught() -> None:
    def outcome(details: str) -> Outcome:
        return Outcome("Vae/Encode", "INVALID_ARGUMENT", details, 0.0, "")

    assert outcome('Traceback (most recent call last):\n  File "x.py", line 3').bad
    assert outcome("error in /work/genserve/services/vae/app.py:81").bad
    assert not outcome("images[0].png: is not a readable image").bad
    assert Outcome("Vae/Encode", "INTERNAL", "internal error (request id 1)", 0.0, "").bad
    assert LEAK.search("see site-packages/ray/serve/_private/proxy.py")
