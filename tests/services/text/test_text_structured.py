"""Structured outputs (xgrammar): sampled outputs of the demo model always satisfy their JSON Schema or regex,
whatever the sampling options, inside a continuous batch with unconstrained requests; the mask itself; errors."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch
from text_helpers import VOCAB, byte_tokenizer, hf_model, save_hf

from genserve.services.text.engine.async_engine import DEMO_DIR, AsyncLLMEngine
from genserve.services.text.engine.engine import EngineConfig, LLMEngine
from genserve.services.text.engine.grammar import apply_bitmask
from genserve.services.text.engine.params import InvalidJsonSchema, InvalidRegex, SamplingParams
from genserve.services.text.loader import load_model
from genserve.services.text.tokenizer import TextTokenizer

# A nested object, an array and an enum; sizes bounded so that a sampled 4M-parameter model always completes it
# well within max_tokens (it cannot wander off into an endless string).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "colour": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "admin": {"type": "boolean"}},
            "required": ["id", "admin"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "colour", "size", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,6} (is|was) [0-9]{1,3}(\.[0-9])?!"
MAX_TOKENS = 160  # the schema's longest output is ~130 characters, and every token holds at least one


@pytest.fixture(scope="module")
def demo() -> LLMEngine:
    model = load_model(DEMO_DIR)
    return LLMEngine(model, TextTokenizer.from_dir(DEMO_DIR, model.config.eos_token_ids), EngineConfig())


def sampled(seed: int, **options) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": seed, **options})


def test_50_sampled_json_outputs_validate_inside_a_batch_with_unconstrained_requests(demo):
    prompt = demo.tokenizer.encode("A record:")
    free = [sampled(100 + i, max_tokens=24) for i in range(4)]
    alone = demo.generate_batch([prompt] * 4, free)
    schema = json.dumps(SCHEMA)
    results = demo.generate_batch([prompt] * 54, [sampled(s, json_schema=schema) for s in range(50)] + free)
    for text, ids, reason in results[:50]:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        assert ids[-1] not in demo.eos_ids  # done when only the stop token could follow: not spent on it
    assert len({text for text, _, _ in results[:50]}) > 40  # sampled, not one forced string
    assert results[50:] == alone  # the masks stay on their own rows


def test_a_streamed_structured_request_arrives_as_generated_and_validates(demo):
    engine = AsyncLLMEngine(demo)

    async def collect():
        return [d async for d in engine.stream(demo.tokenizer.encode("A record:"),
                                                sampled(7, json_schema=json.dumps(SCHEMA)))]

    try:
        deltas = asyncio.run(collect())
    finally:
        engine.shutdown()
    # Streamed while generated (a consumer that fell behind gets what waited as one delta: test_text_stream_coalescing)
    assert len(deltas) > 1 and sum(len(d.token_ids) for d in deltas) > 10
    assert deltas[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(d.text for d in deltas)), SCHEMA)


def test_regex_outputs_fullmatch_with_every_sampling_option(demo):
    prompt = demo.tokenizer.encode("She said:")
    options = [dict(temperature=0), dict(top_k=3), dict(top_p=0.5), dict(min_p=0.3), dict(temperature=1.7),
               dict(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5), dict(logprobs=3)]
    params = [sampled(seed, regex=REGEX, **opt) for opt in options for seed in range(4)]
    results = demo.generate_batch([prompt] * len(params), params)
    for (text, _, reason), p in zip(results, params, strict=True):
        assert reason == "stop" and re.fullmatch(REGEX, text), (p, text)
    greedy = {text for (text, _, _), p in zip(results, params, strict=True) if p.greedy}
    assert len(greedy) == 1  # greedy ignores the seed


def test_logprobs_of_a_constrained_request_are_the_models(demo):
    prompt = demo.tokenizer.encode("She said:")
    deltas = []
    demo.add_request("lp", prompt, sampled(1, regex=REGEX, logprobs=2), deltas.append)
    while demo.has_work():
        demo.step()
    first = deltas[0].logprobs[0]
    with torch.inference_mode():
        logp = demo.model(torch.tensor([prompt]))[0, -1].float().log_softmax(-1)
    assert first.logprob == pytest.approx(float(logp[first.token_id]), abs=1e-4)


def test_an_unfinished_grammar_ends_with_length_and_a_valid_prefix(demo):
    prompt = demo.tokenizer.encode("A record:")
    params = sampled(3, max_tokens=6, json_schema=json.dumps(SCHEMA))
    text, ids, reason = demo.generate_batch([prompt], params)[0]
    assert reason == "length" and len(ids) == 6 and text.startswith('{"')
    replay = demo.grammars.compile(params)
    assert all(replay.accept(t) for t in ids) and not replay.done


def test_a_preempted_structured_request_keeps_its_grammar_state(demo):
    tight = LLMEngine(demo.model, demo.tokenizer, EngineConfig(num_blocks=14, block_size=8, max_batched_tokens=32))
    prompt = demo.tokenizer.encode("A record:")
    params = [sampled(s, json_schema=json.dumps(SCHEMA)) for s in range(6)]
    roomy = demo.generate_batch([prompt] * 6, params)
    assert tight.generate_batch([prompt] * 6, params) == roomy
    assert tight.counters().preemptions > 0


@pytest.fixture(scope="module")
def byte_engine(tmp_path_factory) -> LLMEngine:
    """A random model over a 256-byte vocabulary without any stop token."""
    torch.manual_seed(0)
    directory = save_hf(hf_model("llama", vocab_size=VOCAB), tmp_path_factory.mktemp("bytes"), sharded=False)
    return LLMEngine(load_model(directory), byte_tokenizer(), EngineConfig(block_size=4))


def test_a_model_without_stop_tokens_ends_where_the_output_is_complete(byte_engine):
    engine = byte_engine
    assert not engine.eos_ids
    results = engine.generate_batch([[1, 2, 3]] * 8, [sampled(s, max_tokens=40, regex=r"[0-9]{2}-[a-z]{2}")
                                                      for s in range(8)])
    assert all(reason == "stop" and re.fullmatch(r"[0-9]{2}-[a-z]{2}", text) for text, _, reason in results)


def test_invalid_grammars_are_refused_by_name_without_internals(demo):
    with pytest.raises(InvalidJsonSchema, match="foo") as schema_error:
        demo.add_request("bad", [1], SamplingParams(json_schema='{"type": "foo"}'), lambda d: None)
    with pytest.raises(InvalidRegex, match="[Uu]nclosed") as regex_error:
        demo.add_request("bad", [1], SamplingParams(regex="[a-"), lambda d: None)
    for error in (schema_error, regex_error):
        assert ".cc" not in str(error.value) and "Check failed" not in str(error.value)
    with pytest.raises(ValueError, match="regex"):
        SamplingParams(json_schema="{}", regex="a")
    assert not demo.has_work()


def test_bounded_json_strings_refuse_raw_control_characters(demo):
    """xgrammar 0.2's length-bounded strings admit raw control characters; json_grammar closes that gap (sampled
    records of the test above once held an ESC byte inside "name")."""
    params = SamplingParams(json_schema=json.dumps({"type": "object", "properties": {"s": {"type": "string",
                                                                                         "maxLength": 5}}}))
    for char, allowed in (("b", True), ("\x1b", False), ("\t", False)):
        grammar = demo.grammars.compile(params)
        assert all(grammar.accept(t) for t in demo.tokenizer.encode('{"s":"a'))
        assert [grammar.accept(t) for t in demo.tokenizer.encode(char)] == [allowed], repr(char)


def test_the_bitmask_sets_exactly_the_forbidden_tokens_to_minus_infinity():
    vocab = 70  # three words, the last one partly used
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[0, [0, 31, 32, 69]] = True
    allowed[1, ::3] = True
    words = torch.zeros(2, 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 is the sign bit
    logits = torch.randn(2, vocab)
    masked = apply_bitmask(logits, bitmask)
    assert torch.equal(masked.isinf(), ~allowed)
    assert torch.equal(masked[allowed], logits[allowed])


def test_byte_vocab_json_outputs_validate(byte_engine):
    engine = byte_engine
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
              "required": ["k", "n"], "additionalProperties": False}
    for text, _, reason in engine.generate_batch([[5, 6]] * 5, [sampled(s, max_tokens=40,
                                                                        json_schema=json.dumps(schema))
                                                                for s in range(5)]):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), schema)
