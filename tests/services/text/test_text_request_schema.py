"""TextIn, the text service's request schema (shared by gRPC and the HTTP API): the structured-output fields and the
int64 seed bound."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.common.validation import MAX_SEED
from services.text.app import TextIn


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
