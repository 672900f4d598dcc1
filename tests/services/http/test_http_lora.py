"""LoRA adapters and further base models in the OpenAI API without a stack: `model` names one of the text app's
further base models or an adapter (chat, completions, responses), an unknown one is 404 `model_not_found` naming it
(param null, as OpenAI's), the admin routes' errors name `lora_name` / `lora_path`. The routes through the real
stack: tests/e2e/test_e2e_auth.py and tests/e2e/test_e2e_architectures.py."""

from __future__ import annotations

import pytest

from genserve.services.common.errors import InvalidArgument
from genserve.services.http import responses, text
from genserve.services.http.app import LORA_FIELDS, TEXT_ERRORS, _check_text_model
from genserve.services.http.errors import ModelNotFound, describe
from genserve.services.http.schemas import ChatBody, CompletionBody, ResponsesBody
from genserve.services.text.engine.params import AdapterCapacityExceeded, AdapterNotFound, InvalidAdapter
from genserve.services.text.schema import UnknownModel

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_a_model_other_than_the_base_is_the_adapter_of_every_request() -> None:
    chat = text.chat_job(ChatBody.model_validate({**CHAT, "model": "org/sql-lora", "n": 2}))
    assert [r.adapter for r in chat.requests] == ["org/sql-lora"] * 2
    completion = text.completion_job(CompletionBody(model="sql", prompt=["a", "b"]))
    assert [r.adapter for r in completion.requests] == ["sql", "sql"]
    turn = responses.prepare(ResponsesBody(model="sql", input="hi"), responses.ResponseStore(4, 60.0))
    assert turn.request.adapter == "sql"
    base = text.chat_job(ChatBody.model_validate({**CHAT, "model": "text"}))
    assert not base.requests[0].HasField("adapter")  # the base model: no adapter at all


def test_a_further_base_model_is_the_model_field_and_any_other_name_an_adapter() -> None:
    served = {"qwen3"}
    assert text.model_fields("text", served) == {} and text.model_fields("sql", served) == {"adapter": "sql"}
    target = text.model_fields("qwen3", served)
    chat = text.chat_job(ChatBody.model_validate({**CHAT, "model": "qwen3", "n": 2}), target)
    assert [r.model for r in chat.requests] == ["qwen3"] * 2 and not chat.requests[0].HasField("adapter")
    completion = text.completion_job(CompletionBody(model="qwen3", prompt="a"), target)
    assert completion.requests[0].model == "qwen3"
    turn = responses.prepare(ResponsesBody(model="qwen3", input="hi"), responses.ResponseStore(4, 60.0), target)
    assert turn.request.model == "qwen3" and not turn.request.HasField("adapter")


def test_a_base_model_not_served_is_404_model_not_found_naming_it() -> None:
    fields = text.body_fields(ChatBody.model_validate({**CHAT, "model": "qwen3"}))
    status, body = describe(UnknownModel("model 'qwen3' is not served here"), "rid", fields, TEXT_ERRORS)
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    assert body["error"]["message"] == "model: model 'qwen3' is not served here"


@pytest.mark.parametrize("model", ["diffusion", "no spaces", "x" * 129, "", "é"])
def test_a_model_no_adapter_may_be_named_is_404_naming_it(model: str) -> None:
    with pytest.raises(ModelNotFound, match=repr(model)):
        _check_text_model(model, "/v1/chat/completions")
    status, body = describe(ModelNotFound(model, "/v1/chat/completions"), "rid")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_an_adapter_not_loaded_is_404_model_not_found_naming_it_in_openais_shape() -> None:
    fields = text.body_fields(ChatBody.model_validate({**CHAT, "model": "sql"}))
    status, body = describe(AdapterNotFound("adapter 'sql' is not loaded"), "rid", fields, TEXT_ERRORS)
    assert status == 404
    assert body["error"] == {"message": "model: adapter 'sql' is not loaded", "type": "invalid_request_error",
                             "param": None, "code": "model_not_found"}
    status, body = describe(AdapterNotFound("adapter 'sql' is not loaded"), "rid", responses.FIELDS,
                            responses.KNOWN)
    assert (status, body["error"]["param"]) == (404, None)
    assert body["error"]["message"] == "model: adapter 'sql' is not loaded"


def test_the_admin_routes_errors_name_their_body_fields() -> None:
    status, body = describe(InvalidAdapter("adapter path '../x' is outside the adapter root /r"), "rid",
                            LORA_FIELDS, TEXT_ERRORS)
    assert status == 400 and body["error"]["param"] == "lora_path"
    assert body["error"]["message"].startswith("lora_path: adapter path '../x' is outside")
    status, body = describe(InvalidArgument("name", "must be 1..128 of ..."), "rid", LORA_FIELDS, TEXT_ERRORS)
    assert (status, body["error"]["param"]) == (400, "lora_name")
    status, body = describe(AdapterNotFound("adapter 'x' is not loaded"), "rid", LORA_FIELDS, TEXT_ERRORS)
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    status, _ = describe(AdapterCapacityExceeded("cannot hold adapter 'x'"), "rid", LORA_FIELDS, TEXT_ERRORS)
    assert status == 429
