"""A model of a new family served through the whole stack (issue 31): a tiny random DeepSeek-V3 checkpoint (multi-head
latent attention over the latent paged cache, grouped sigmoid routing, shared experts, YaRN) behind the text and http
apps of the session's models_stack (tests/e2e/conftest.py), asked over gRPC and over the OpenAI API; every answer is
transformers' greedy continuation of the same ids."""

from __future__ import annotations

import openai
import pytest
import torch

from genserve.services.client import Client
from tests.e2e.served_checkpoints import TEXT_ARGS, byte_tokenizer

pytestmark = pytest.mark.slow
NEW = 12


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, len(ids):].tolist()


def test_grpc_and_openai_answers_are_the_transformers_continuation(deepseek, models_stack) -> None:
    hf, folder = deepseek
    prompt = "MLA caches a latent"
    with Client(models_stack.address, timeout=120) as client:
        info = client.model_info()
        assert info.model_name == folder.name and info.dtype == "float32" and info.max_running == 7
        per_block = info.kv_cache_bytes // info.kv_blocks_total
        assert info.kv_cache_bytes <= TEXT_ARGS["kv_cache_bytes"] < info.kv_cache_bytes + per_block
        ids = list(client.tokenize(prompt).token_ids)
        expected = _hf_greedy(hf, ids)
        reply = client.generate(prompt, max_tokens=NEW, temperature=0)
        assert list(reply.token_ids) == expected and reply.finish_reason == "length"

        api = openai.OpenAI(base_url=models_stack.http_url, api_key="unused", max_retries=0, timeout=120)
        completion = api.completions.create(model="text", prompt=prompt, max_tokens=NEW, temperature=0)
        assert completion.choices[0].text == reply.text

        messages = [{"role": "user", "content": "Which heads share the RoPE key?"}]
        chat_ids = list(client.tokenize(messages=messages).token_ids)
        answer = api.chat.completions.create(model="text", messages=messages, max_tokens=NEW, temperature=0)
        assert answer.usage.prompt_tokens == len(chat_ids)
        assert answer.choices[0].message.content == byte_tokenizer().decode(_hf_greedy(hf, chat_ids))
