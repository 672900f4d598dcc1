"""TextIn, the text service's request schema (shared by gRPC and the HTTP API): the structured-output fields and the
int64 seed bound."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from genserve.services.text.engine.params import MIN_REPETITION_PENALTY, MIN_TEMPERATURE, SamplingParams
from genserve.services.text.schema import MAX_SCHEMA_DEPTH, TextIn, json_depth
from genserve.shared.seeds import MAX_SEED


def error_loc(**fields) -> tuple:
    with pytest.raises(ValidationError) as error:
        TextIn.model_validate({"prompt": "hi", **fields})
    return error.value.errors()[0]["loc"]


def test_json_schema_must_be_a_json_object() -> None:
    assert TextIn.model_validate({"prompt": "hi", "json_schema": '{"type": "object"}'}).json_schema
    assert error_loc(json_schema="{not json") == ("json_schema",)
    assert error_loc(json_schema="[1, 2]") == ("json_schema",)


def test_at_most_one_grammar() -> None:
    assert TextIn.model_validate({"prompt": "hi", "regex": "[a-z]+"}).regex == "[a-z]+"
    assert error_loc(json_schema='{"type": "string"}', regex="a+") == ("regex",)


def test_seed_fits_int64() -> None:
    assert TextIn.model_validate({"prompt": "hi", "seed": MAX_SEED}).seed == MAX_SEED
    assert error_loc(seed=MAX_SEED + 1) == ("seed",)


def error_message(**fields) -> str:
    with pytest.raises(ValidationError) as error:
        TextIn.model_validate({"prompt": "hi", **fields})
    first = error.value.errors()[0]
    return f"{first['loc'][0]}: {first['msg']}"


def nested_items(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + "{}" + "}" * depth


def test_json_schema_nesting_is_capped_before_it_costs_seconds() -> None:
    """Found by the gRPC fuzzer: 16,000 `[` made json.loads raise RecursionError (INTERNAL), and a 400-deep valid
    schema took seconds in xgrammar."""
    assert json_depth({"a": [1, {"b": []}]}) == 4 and json_depth(3) == 0
    assert TextIn.model_validate({"prompt": "hi", "json_schema": nested_items(MAX_SCHEMA_DEPTH - 1)}).json_schema
    assert error_message(json_schema=nested_items(MAX_SCHEMA_DEPTH)) == (
        f"json_schema: Value error, nests deeper than {MAX_SCHEMA_DEPTH} levels")
    assert "nests deeper" in error_message(json_schema="[" * 16_000)
    assert "nests deeper" in error_message(json_schema='{"anyOf": [' * 800 + "{}" + "]}" * 800)


def test_json_schema_numbers_must_be_finite() -> None:
    """xgrammar answered `RuntimeError` (its message empty) for a bound of 1e400, which json reads as inf."""
    assert "number 1e400 is out of range" in error_message(json_schema='{"type": "integer", "minimum": 1e400}')
    assert "NaN is not a JSON number" in error_message(json_schema='{"type": "number", "minimum": NaN}')
    assert TextIn.model_validate({"prompt": "hi", "json_schema": '{"type": "number", "maximum": 1.5e300}'})


@pytest.mark.parametrize("regex", [".{0,4294967295}", "a{4294967296}"])
def test_a_repeat_count_python_cannot_hold_is_invalid(regex: str) -> None:
    """Found by the gRPC fuzzer: re.compile raised OverflowError, which became INTERNAL."""
    assert error_message(regex=regex) == (
        "regex: Value error, is not a valid regular expression (the repetition number is too large)")


def test_a_regex_nested_past_the_parser_recursion_is_invalid() -> None:
    assert error_message(regex="(" * 511 + ")" * 511) == "regex: Value error, nests too deeply"


@pytest.mark.parametrize("field, value", [("temperature", 1.4e-45), ("temperature", 0.001),
                                          ("repetition_penalty", 1.4e-45)])
def test_a_divisor_small_enough_to_overflow_the_logits_is_refused(field: str, value: float) -> None:
    """Found by the gRPC fuzzer: temperature 1.4e-45 (float32's smallest) made every logit inf; the sampled id was
    garbage, decoding it raised in the engine loop, every request in the batch failed and the replica was
    restarted."""
    assert error_message(**{field: value}).startswith(f"{field}: ")
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_greedy_and_the_floors_themselves_are_served() -> None:
    for fields in ({"temperature": 0.0}, {"temperature": MIN_TEMPERATURE},
                   {"repetition_penalty": MIN_REPETITION_PENALTY}):
        assert TextIn.model_validate({"prompt": "hi", **fields}).sampling_params(room=8)
