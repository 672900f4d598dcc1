"""Every family of issue 31 served through the whole stack: the session's models_stack (tests/e2e/conftest.py) runs a
text app whose first model is a tiny random DeepSeek-V3 (multi-head latent attention over the latent paged cache,
grouped sigmoid routing, shared experts, YaRN) and whose further `models` are one tiny random checkpoint of each other
family (Qwen3, Qwen3-MoE, Mixtral, Gemma 2, Gemma 3, Phi-3 with longrope, gpt-oss), asked over gRPC and over the
OpenAI API; every answer is transformers' greedy continuation of the same ids."""

from __future__ import annotations

import openai
import pytest
import torch

from genserve.services.client import Client
from genserve.services.client.errors import InvalidArgument, NotFound
from tests.e2e.served_checkpoints import FURTHER, TEXT_ARGS, byte_tokenizer

pytestmark = pytest.mark.slow
NEW = 12


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, len(ids):].tolist()


def _api(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=120)


def test_grpc_and_openai_answers_are_the_transformers_continuation(deepseek, models_stack) -> None:
    hf, folder = deepseek
    prompt = "MLA caches a latent"
    with Client(models_stack.address, timeout=120) as client:
        info = client.model_info()
        assert info.model_name == folder.name and info.dtype == "float32" and info.max_running == 7
        assert list(info.models) == list(FURTHER)
        per_block = info.kv_cache_bytes // info.kv_blocks_total
        assert info.kv_cache_bytes <= TEXT_ARGS["kv_cache_bytes"] < info.kv_cache_bytes + per_block
        ids = list(client.tokenize(prompt).token_ids)
        expected = _hf_greedy(hf, ids)
        reply = client.generate(prompt, max_tokens=NEW, temperature=0)
        assert list(reply.token_ids) == expected and reply.finish_reason == "length"

        api = _api(models_stack)
        completion = api.completions.create(model="text", prompt=prompt, max_tokens=NEW, temperature=0)
        assert completion.choices[0].text == reply.text

        messages = [{"role": "user", "content": "Which heads share the RoPE key?"}]
        chat_ids = list(client.tokenize(messages=messages).token_ids)
        answer = api.chat.completions.create(model="text", messages=messages, max_tokens=NEW, temperature=0)
        assert answer.usage.prompt_tokens == len(chat_ids)
        assert answer.choices[0].message.content == byte_tokenizer().decode(_hf_greedy(hf, chat_ids))


@pytest.mark.parametrize("family", FURTHER)
def test_each_family_answers_by_name_as_transformers_does(family, families, models_stack) -> None:
    hf, folder = families[family]
    # past the 8-token windows of the sliding layers, and past Phi-3's 48-token original context with the answer
    prompt = f"{family} serves the models people bring, window after window, long context too"
    with Client(models_stack.address, timeout=120) as client:
        info = client.model_info(family)
        assert (info.model_name, info.architecture) == (folder.name, type(hf).__name__)
        assert info.max_running == 7 and list(info.models) == list(FURTHER) and not info.adapters
        ids = list(client.tokenize(prompt, model=family).token_ids)
        reply = client.generate(prompt, model=family, max_tokens=NEW, temperature=0)
        assert list(reply.token_ids) == _hf_greedy(hf, ids) and reply.finish_reason == "length"
        streamed = [c for c in client.generate_stream(prompt, model=family, max_tokens=NEW, temperature=0)]
        assert [t for c in streamed for t in c.token_ids] == list(reply.token_ids)

        api = _api(models_stack)
        completion = api.completions.create(model=family, prompt=prompt, max_tokens=NEW, temperature=0)
        assert completion.model == family and completion.choices[0].text == reply.text
        messages = [{"role": "user", "content": f"What does {family} add?"}]
        chat_ids = list(client.tokenize(messages=messages, model=family).token_ids)
        chat = client.generate(messages=messages, model=family, max_tokens=NEW, temperature=0)
        assert list(chat.token_ids) == _hf_greedy(hf, chat_ids)
        answer = api.chat.completions.create(model=family, messages=messages, max_tokens=NEW, temperature=0)
        assert answer.usage.prompt_tokens == len(chat_ids) and answer.choices[0].message.content == chat.text


def test_the_models_are_listed_and_an_unknown_one_is_named(families, models_stack) -> None:
    api = _api(models_stack)
    listed = {m.id: m for m in api.models.list().data}
    assert set(FURTHER) <= set(listed) and {"text", "diffusion"} <= set(listed)
    assert all(listed[f].root == families[f][1].name for f in FURTHER)
    with Client(models_stack.address, timeout=60) as client:
        with pytest.raises(NotFound, match="model"):
            client.generate("hi", model="llama-9000", max_tokens=2)
        with pytest.raises(NotFound, match="model"):
            client.model_info("llama-9000")
        with pytest.raises(InvalidArgument, match="adapter"):
            client.generate("hi", model=FURTHER[0], adapter="sql", max_tokens=2)
        assert len(client.generate("still serving", model=FURTHER[0], max_tokens=2, temperature=0).token_ids) == 2
    with pytest.raises(openai.NotFoundError, match="'llama-9000' is no LoRA adapter .* further models .*'qwen3'"):
        api.completions.create(model="llama-9000", prompt="hi", max_tokens=2)
