"""Unit behaviour of the engine's parts: detokenizer, stop checker, sampler, block manager, configs, loader."""

from __future__ import annotations

import json

import pytest
import torch
from text_helpers import byte_tokenizer

from genserve.services.text.config import LlamaConfig, from_hf, to_hf
from genserve.services.text.engine.detokenizer import IncrementalDetokenizer, StopChecker
from genserve.services.text.engine.kv_cache import BlockManager, block_bytes
from genserve.services.text.engine.params import SamplingParams
from genserve.services.text.engine.sampler import (
    apply_penalties,
    draw_batch,
    filter_logits_batch,
    make_generator,
    penalize_batch,
)
from genserve.services.text.loader import load_model, weight_files
from genserve.services.text.tokenizer import TextTokenizer

UNICODE_TEXT = "naïve café — 世界 🙂 ok"


def test_incremental_detokenization_never_splits_a_utf8_character():
    tok = byte_tokenizer()
    ids = tok.encode(UNICODE_TEXT)
    assert len(ids) == len(UNICODE_TEXT.encode("utf-8"))  # one token per byte: multi-byte chars span tokens
    detok = IncrementalDetokenizer(tok.decode, tok.encode("prompt: "))
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == UNICODE_TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[ids.index(0xF0)] == ""  # the first byte of the emoji alone produces no text


def test_stop_checker_holds_back_a_possible_stop_prefix():
    stop = StopChecker(("END",))
    assert not stop.add("abc E")
    assert stop.take(final=False) == "abc"  # " E" could begin "END"... only the last 2 chars are held
    assert not stop.add("N")
    assert stop.take(final=False) == " "
    assert stop.add("D and more")
    assert stop.take(final=True) == "E"[:0] and stop.text == "abc "


def test_sampling_params_validation_names_the_field():
    for kwargs, field in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                          ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"), ({"min_p": 2}, "min_p"),
                          ({"repetition_penalty": 0}, "repetition_penalty"), ({"stop": ("",)}, "stop"),
                          ({"logprobs": 99}, "logprobs"), ({"temperature": float("nan")}, "temperature")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    assert SamplingParams(stop="x").stop == ("x",)


def test_top_k_top_p_min_p_keep_exactly_the_expected_tokens():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))
    def kept(**kw) -> list[int]:
        filtered = filter_logits_batch(logits[None], [SamplingParams(**kw)])[0]
        return torch.isfinite(filtered).nonzero().flatten().tolist()

    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.75) == [0, 1]  # 0.5 + 0.25 reaches 0.75: the third token is dropped
    assert kept(top_p=0.76) == [0, 1, 2]
    assert kept(min_p=0.2) == [0, 1, 2]  # keep p >= 0.2 * 0.5 = 0.1
    assert kept(top_p=1.0) == [0, 1, 2, 3, 4]


def _draw(logits: torch.Tensor, generator: torch.Generator) -> int:
    return int(draw_batch(logits[None], torch.rand((1,), generator=generator, dtype=torch.float64))[0])


def test_draw_follows_the_distribution_and_the_seed():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    g = make_generator(3)
    counts = torch.bincount(torch.tensor([_draw(logits, g) for _ in range(4000)]), minlength=3).float() / 4000
    assert torch.allclose(counts, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)
    a, b = make_generator(5), make_generator(5)
    assert [_draw(logits, a) for _ in range(20)] == [_draw(logits, b) for _ in range(20)]


def test_penalties_follow_ctrl_and_openai_definitions():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt_ids=[0], output_ids=[1])
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]
    pf = apply_penalties(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [0], [2, 2, 3])
    assert pf.tolist() == [2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25]



def _penalized_row(x: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The definitions written out token by token."""
    x = x.clone()
    for t in set(prompt) | set(output) if params.repetition_penalty != 1 else ():
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return x


def test_penalties_of_a_batch_are_each_rows_own():
    """Rows with different settings (one with none) in one pass on the device, repeated ids counted (issue 37,
    defect 8: no Python set per row and step)."""
    logits = torch.randn(4, 50) * 3
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(),
              SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-0.3, frequency_penalty=0.1)]
    prompts, outputs = [[1, 2, 2, 49], [3], [4, 5], [0, 7]], [[2, 9, 9], [3, 3], [5, 5, 5, 6], []]
    got = penalize_batch(logits, params, prompts, outputs)
    for i in range(4):
        torch.testing.assert_close(got[i], _penalized_row(logits[i], params[i], prompts[i], outputs[i]))
    assert torch.equal(got[1], logits[1])

def test_block_manager_grows_frees_and_sizes_from_the_memory_budget():
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.grow("a", 9) and len(bm.tables["a"]) == 3 and bm.num_free == 2
    assert not bm.can_grow("b", 9)
    with pytest.raises(MemoryError):
        bm.grow("b", 9)
    assert bm.free("a") == 3 and bm.num_free == 5
    # 2 (K, V) x 2 layers x 2 kv heads x 8 dims x 4 bytes x 4 tokens = 1024 bytes per block
    assert block_bytes(4, 2, 2, 8, torch.float32) == 1024


def test_config_reads_transformers_4_and_5_spellings():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    old = from_hf({**base, "rope_theta": 5e5, "torch_dtype": "bfloat16",
                   "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = from_hf({**base, "dtype": "bfloat16", "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear",
                                                                  "factor": 2.0}})
    assert old.rope_theta == new.rope_theta == 5e5 and old.dtype == new.dtype == "bfloat16"
    assert dict(old.rope_scaling)["factor"] == dict(new.rope_scaling)["factor"] == 2.0
    assert old.head_dim == 16 and old.n_kv_heads == 2
    qwen = from_hf({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8, "use_sliding_window": False})
    assert qwen.sliding_window == 0 and qwen.qkv_bias
    assert from_hf(to_hf(new)) == new
    with pytest.raises(ValueError, match="architecture"):
        from_hf({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(n_heads=8, n_kv_heads=3)


def test_pickle_only_checkpoints_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ValueError, match="pickled weights"):
        weight_files(tmp_path)
    with pytest.raises(ValueError, match="safetensors only"):
        load_model(tmp_path)


def test_chat_template_renders_messages_and_validates_them():
    tok = TextTokenizer(byte_tokenizer()._tok, {"chat_template": "{% for m in messages %}<{{ m['role'] }}>"
                                                "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}"
                                                "<assistant>{% endif %}", "eos_token": "!"})
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<user>hi<assistant>"
    assert tok.eos_token_id == tok.encode("!")[0]
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "no role"}])


def test_int8_weight_only_linear_stays_within_quantisation_error():
    from genserve.services.text.quantize import Int8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 96, bias=True)
    x = torch.randn(5, 512)
    q = Int8Linear(linear)
    assert q.weight.dtype == torch.int8 and q.scales.shape == (96,)
    with torch.no_grad():
        ref, got = linear(x), q(x)
    # per-channel int8 rounding (~0.8% of the weights' std) plus bf16 activations (~0.4%)
    assert ((got - ref).norm() / ref.norm()).item() < 0.02


def test_int8_checkpoint_loading_reports_its_dtype_and_size(tmp_path):
    from genserve.services.text.loader import save_model
    from genserve.services.text.model import LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_position=64,
                      tie_embeddings=True)
    save_model(tmp_path, LlamaForCausalLM(cfg))
    fp32, int8 = load_model(tmp_path, "float32"), load_model(tmp_path, "int8")
    assert int8.config.dtype == "int8" and int8.num_params() == fp32.num_params()
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        a, b = fp32(ids), int8(ids)
    assert ((a - b).norm() / a.norm()).item() < 0.05
