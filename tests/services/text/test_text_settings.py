"""Engine settings from a serve config's `args` reach the text replica: the deployment class built in this process
from those args (as Serve builds it, without Ray) reports them through GetModelInfo and decodes. The YAML-to-replica
path itself runs end to end on the models stack (tests/e2e/test_e2e_architectures.py), and a bad setting failing
the deploy in tests/e2e/test_e2e_serve_settings.py."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from pydantic import ValidationError
from text_helpers import byte_tokenizer, hf_model, make_engine, save_hf

from genserve.services.common.errors import InvalidArgument
from genserve.services.text.app import TextGeneration
from genserve.services.text.engine.params import AdapterNotFound, SamplingParams
from genserve.services.text.schema import UnknownModel
from genserve.services.text.settings import TextArgs
from genserve.v1 import text_pb2

KV_BUDGET = 3 * 2**20


def test_dtype_kv_budget_and_max_running_from_the_args_take_effect() -> None:
    args = TextArgs.model_validate({"dtype": "bfloat16", "kv_cache_bytes": KV_BUDGET, "max_running": 7})
    app = TextGeneration.func_or_class(None, args)
    try:
        async def ask() -> tuple[text_pb2.ModelInfo, text_pb2.TextResponse]:
            return (await app.GetModelInfo(text_pb2.ModelInfoRequest()),
                    await app.Generate(text_pb2.TextRequest(prompt="The", max_tokens=3, temperature=0.0)))

        info, reply = asyncio.run(ask())
        assert info.dtype == "bfloat16" and info.max_running == 7 and len(reply.token_ids) == 3
        assert next(app.engine.engine.model.parameters()).dtype == torch.bfloat16
        per_block = info.kv_cache_bytes // info.kv_blocks_total
        assert info.kv_cache_bytes == info.kv_blocks_total * per_block
        assert info.kv_cache_bytes <= KV_BUDGET < info.kv_cache_bytes + per_block
    finally:
        app.engine.shutdown()


def test_speculation_and_jump_forward_report_their_method_and_counts() -> None:
    args = TextArgs.model_validate({"speculative": {"method": "ngram"}, "max_jump_forward": 4})
    app = TextGeneration.func_or_class(None, args)
    schema = {"type": "object", "properties": {"colour": {"enum": ["crimson", "turquoise"]}}, "required": ["colour"],
              "additionalProperties": False}
    try:
        async def ask() -> text_pb2.ModelInfo:
            quote = "def add(a, b):\n    return a + b\n\n" * 4
            await app.Generate(text_pb2.TextRequest(prompt=quote, max_tokens=16, temperature=0.0))
            await app.Generate(text_pb2.TextRequest(prompt="A record:", max_tokens=40, temperature=0.0,
                                                    json_schema=json.dumps(schema)))
            return await app.GetModelInfo(text_pb2.ModelInfoRequest())

        info = asyncio.run(ask())
        assert info.speculative == "ngram" and info.max_jump_forward == 4
        assert info.spec_proposed_tokens > 0
        assert info.spec_acceptance_rate == info.spec_accepted_tokens / info.spec_proposed_tokens
        assert info.forced_accepted_tokens > 0 and info.forced_proposed_tokens >= info.forced_accepted_tokens
    finally:
        app.engine.shutdown()


def test_further_models_answer_by_name_each_with_its_own_engine(tmp_path) -> None:
    """`models` beside the first: a request's `model` picks the engine, whose tokens are those of an engine that
    serves that checkpoint alone; GetModelInfo describes either; a name not served is NOT_FOUND naming `model`."""
    folder = save_hf(hf_model("mistral", sliding_window=8), tmp_path / "mistral", sharded=False)
    byte_tokenizer()._tok.save(str(folder / "tokenizer.json"))
    app = TextGeneration.func_or_class(None, TextArgs.model_validate({"models": {"mistral": str(folder)},
                                                                      "max_running": 5}))
    prompt = "a window of eight tokens slides"
    try:
        async def ask() -> tuple:
            return (await app.GetModelInfo(text_pb2.ModelInfoRequest()),
                    await app.GetModelInfo(text_pb2.ModelInfoRequest(model="mistral")),
                    await app.Generate(text_pb2.TextRequest(prompt=prompt, model="mistral", max_tokens=6,
                                                            temperature=0.0)),
                    await app.Tokenize(text_pb2.TokenizeRequest(text=prompt, model="mistral")))

        first, further, reply, tokens = asyncio.run(ask())
        assert list(first.models) == list(further.models) == ["mistral"]
        assert first.architecture == "LlamaForCausalLM" and further.architecture == "MistralForCausalLM"
        assert further.model_name == "mistral" and further.max_running == 5
        alone = make_engine(folder).generate_batch([list(tokens.token_ids)],
                                                   [SamplingParams(max_tokens=6, temperature=0)])
        assert list(reply.token_ids) == alone[0][1]
        with pytest.raises(UnknownModel, match="'llama-9000' is not served here .*'mistral'"):
            asyncio.run(app.Generate(text_pb2.TextRequest(prompt=prompt, model="llama-9000")))
        with pytest.raises(InvalidArgument, match="adapter"):
            asyncio.run(app.Generate(text_pb2.TextRequest(prompt=prompt, model="mistral", adapter="sql")))
        with pytest.raises(AdapterNotFound, match="'sql' is no LoRA adapter .* further models \\('mistral'"):
            asyncio.run(app.Generate(text_pb2.TextRequest(prompt=prompt, adapter="sql")))
    finally:
        for engine in app.engines.values():
            engine.shutdown()


@pytest.mark.parametrize(("models", "lora", "named"), [
    ({"text": "."}, None, "'text' is not a model name"),
    ({"bad name": "."}, None, "'bad name' is not a model name"),
    ({"m": "/no/such/folder"}, None, "models.m: '/no/such/folder' is no folder or file"),
    ({"sql": "."}, {"root": ".", "adapters": {"sql": "sql"}}, "'sql' is also the name of a LoRA adapter"),
])
def test_a_further_model_that_cannot_be_served_fails_the_deploy_naming_it(models, lora, named) -> None:
    with pytest.raises(ValidationError, match=named):
        TextArgs.model_validate({"models": models, "lora": lora})
