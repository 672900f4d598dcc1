"""A model of a new family served through the whole stack (issue 31): a tiny random DeepSeek-V3 checkpoint (multi-head
latent attention over the latent paged cache, grouped sigmoid routing, shared experts, YaRN) behind the text and http
apps, asked over gRPC and over the OpenAI API; every answer is transformers' greedy continuation of the same ids."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai
import pytest
import torch

from genserve.services.client import Client
from tests.e2e.serve_configs import serve_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services" / "text"))
from test_text_architectures import COMMON, _configs, _randomise  # noqa: E402
from text_helpers import byte_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
NEW = 12
SETTINGS = {"kv_cache_bytes": 256 * 2**10, "max_running": 7}  # 256 KiB: two full contexts of this tiny model


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    cfg_cls, model_cls, extra = _configs()["deepseek_v3"]
    hf = model_cls(cfg_cls(**{**COMMON, **extra}, attn_implementation="eager")).eval()
    _randomise(hf, unit_offset=False)
    folder = tmp_path_factory.mktemp("deepseek")
    hf.save_pretrained(folder)
    byte_tokenizer()._tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return hf, folder


@pytest.fixture(scope="module")
def deepseek_stack(deepseek, serve, base_port, tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-stack")
    # Engine settings from the config's args reach the replica too (GetModelInfo below); float32 keeps the parity.
    config = serve_config(folder, ("text", "http"), {"text": {"dtype": "float32", **SETTINGS}})
    with serve(base_port + 60, folder / "serve.log", "--config", str(config),
               "--text-model", str(deepseek[1])) as running:
        yield running


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, len(ids):].tolist()


def test_grpc_and_openai_answers_are_the_transformers_continuation(deepseek, deepseek_stack) -> None:
    hf, folder = deepseek
    prompt = "MLA caches a latent"
    with Client(deepseek_stack.address, timeout=120) as client:
        info = client.model_info()
        assert info.model_name == folder.name and info.dtype == "float32" and info.max_running == 7
        per_block = info.kv_cache_bytes // info.kv_blocks_total
        assert info.kv_cache_bytes <= SETTINGS["kv_cache_bytes"] < info.kv_cache_bytes + per_block
        ids = list(client.tokenize(prompt).token_ids)
        expected = _hf_greedy(hf, ids)
        reply = client.generate(prompt, max_tokens=NEW, temperature=0)
        assert list(reply.token_ids) == expected and reply.finish_reason == "length"

        api = openai.OpenAI(base_url=deepseek_stack.http_url, api_key="unused", max_retries=0, timeout=120)
        completion = api.completions.create(model="text", prompt=prompt, max_tokens=NEW, temperature=0)
        assert completion.choices[0].text == reply.text

        messages = [{"role": "user", "content": "Which heads share the RoPE key?"}]
        chat_ids = list(client.tokenize(messages=messages).token_ids)
        answer = api.chat.completions.create(model="text", messages=messages, max_tokens=NEW, temperature=0)
        assert answer.usage.prompt_tokens == len(chat_ids)
        assert answer.choices[0].message.content == byte_tokenizer().decode(_hf_greedy(hf, chat_ids))
