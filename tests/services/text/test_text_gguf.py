"""GGUF checkpoints against transformers' own GGUF loading: tiny files written with gguf.GGUFWriter from random HF
Llama, Mistral, Qwen2, Phi-3, Qwen3-MoE, Mixtral, gpt-oss and DeepSeek-V3 models in F32, Q8_0, Q4_1 and MXFP4; the
tokenizer from the metadata; refusals by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize
from gguf_helpers import CHATML, write_gguf
from text_helpers import VOCAB, byte_tokenizer, hf_model
from tokenizers import Tokenizer

from genserve.services.text.engine.engine import EngineConfig, LLMEngine
from genserve.services.text.engine.params import SamplingParams
from genserve.services.text.gguf import GGUFCheckpoint, tensor_weight, unpermute_index
from genserve.services.text.loader import load_model
from genserve.services.text.tokenizer import NoChatTemplate, TextTokenizer
from genserve.shared.blocks.quant_linear import QuantLinear

LOGITS_ATOL = 1e-4
NEW_TOKENS = 24
ARCHS = {"llama": {}, "mistral": {}, "qwen2": {"tie_word_embeddings": True}, "phi3": {}}
OUR_ARCH = {"qwen2": "Qwen2ForCausalLM", "phi3": "Phi3ForCausalLM"}  # else LlamaForCausalLM
DEMO_TOKENIZER = "services/text/weights/tokenizer.json"


@pytest.fixture(scope="module", params=[(a, q) for a in ARCHS for q in ("F32", "Q8_0", "Q4_1")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def gguf_file(request, tmp_path_factory):
    arch, qtype = request.param
    hf = hf_model(arch, **ARCHS[arch])
    path = write_gguf(tmp_path_factory.mktemp("gguf") / f"{arch}-{qtype}.gguf", hf, qtype, byte_tokenizer()._tok)
    # GGUF has no padding id; transformers' Phi-3 config would default it past this vocabulary.
    reference = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32, pad_token_id=None).eval()
    return arch, qtype, hf, path, reference


def _quant_layers(model) -> int:
    return sum(isinstance(m, QuantLinear) for m in model.modules())


@pytest.mark.parametrize("keep", [False, True], ids=["dequantized", "kept-quantized"])
def test_logits_match_transformers_loading_the_same_file(gguf_file, keep):
    arch, qtype, hf, path, reference = gguf_file
    model = load_model(path, keep_quantized=keep)
    # Kept: every projection and the LM head (tied or not) run on the file's blocks; the embedding stays dense.
    assert _quant_layers(model) == (7 * model.config.n_layers + 1 if keep and qtype != "F32" else 0)
    assert model.config.architecture == OUR_ARCH.get(arch, "LlamaForCausalLM")
    assert model.config.tie_embeddings == (arch == "qwen2")
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model(ids)
        assert (got - reference(ids).logits).abs().max().item() <= LOGITS_ATOL
        drift = (got - hf(ids).logits).abs().max().item()
    # F32 is the HF model itself (the permutation round-trips); quantized files are near it, not equal.
    assert drift <= LOGITS_ATOL if qtype == "F32" else 1e-3 < drift < 2.0


@pytest.mark.parametrize("keep", [False, True], ids=["dequantized", "kept-quantized"])
def test_greedy_tokens_match_transformers(gguf_file, keep):
    _, _, _, path, reference = gguf_file
    prompt = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(4)).tolist()
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
    engine = LLMEngine(load_model(path, keep_quantized=keep), byte_tokenizer(), EngineConfig(num_blocks=16))
    _, tokens, reason = engine.generate_batch([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))[0]
    assert (tokens, reason) == (expected, "length")


def test_phi3_longrope_factors_come_from_the_file(tmp_path):
    """Phi-3 with longrope, as convert_hf_to_gguf writes it (factor tensors, the original context in metadata):
    the same config and logits as the Hugging Face folder, kept-quantized projections split from the fused ones.
    transformers' GGUF loader reads no longrope, so the folder is the reference."""
    hf = hf_model("phi3", original_max_position_embeddings=48, max_position_embeddings=512, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.5 + 0.4 * i for i in range(8)]})
    hf.save_pretrained(tmp_path / "hf")
    folder = load_model(tmp_path / "hf")
    ids = torch.randint(0, VOCAB, (2, 120), generator=torch.Generator().manual_seed(3))  # past the original 48
    for qtype in ("F32", "Q8_0"):
        model = load_model(write_gguf(tmp_path / f"phi3-{qtype}.gguf", hf, qtype, byte_tokenizer()._tok),
                           keep_quantized=True)
        scaling = dict(model.config.rope_scaling)
        assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 48
        assert np.allclose(scaling["long_factor"], [1.5 + 0.4 * i for i in range(8)])
        assert _quant_layers(model) == (7 * model.config.n_layers + 1 if qtype != "F32" else 0)
        with torch.no_grad():
            drift = (model(ids) - folder(ids)).abs().max().item()
        assert drift <= LOGITS_ATOL if qtype == "F32" else 1e-3 < drift < 1.0


# transformers' GGUF reader leaves these two at its config's defaults: GGUF stores the experts' width as
# expert_feed_forward_length, and llama.cpp's qwen3moe graph always renormalises the top-k weights.
QWEN3_MOE = dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1"])
def test_qwen3_moe_experts_load_from_their_stacked_tensors(tmp_path, qtype):
    hf = hf_model("qwen3_moe", **QWEN3_MOE)
    path = write_gguf(tmp_path / f"qwen3moe-{qtype}.gguf", hf, qtype, byte_tokenizer()._tok)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, moe_intermediate_size=32, norm_topk_prob=True).eval()
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    prompt = ids[0, :19].tolist()
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
    for keep in (False, True):
        model = load_model(path, keep_quantized=keep)
        assert model.config.architecture == "Qwen3MoeForCausalLM" and model.config.n_experts == 4
        # Kept: the 4 attention projections and every expert's 3 per layer, and the head; the router stays dense.
        assert _quant_layers(model) == ((4 + 4 * 3) * model.config.n_layers + 1 if keep and qtype != "F32" else 0)
        with torch.no_grad():
            assert (model(ids) - reference(ids).logits).abs().max().item() <= LOGITS_ATOL
        engine = LLMEngine(model, byte_tokenizer(), EngineConfig(num_blocks=16))
        _, tokens, _ = engine.generate_batch([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))[0]
        assert tokens == expected


def _assert_like_hf(model, hf, ids: torch.Tensor, qtype: str) -> None:
    """``model``, loaded from a GGUF file written from ``hf``, against ``hf`` itself: F32 logits within 1e-4 and the
    same 24 greedy tokens through the engine; a quantized file's logits near, not equal."""
    with torch.no_grad():
        drift = (model(ids) - hf(ids).logits).abs().max().item()
    assert drift <= LOGITS_ATOL if qtype == "F32" else 1e-3 < drift < 2.0
    if qtype == "F32":
        prompt = ids[0, :19].tolist()
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
        engine = LLMEngine(model, byte_tokenizer(), EngineConfig(num_blocks=16))
        assert engine.generate_batch([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))[0][1] == expected


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_mixtral_is_a_llama_file_with_experts(tmp_path, qtype):
    """llama.cpp converts Mixtral as `llama` (q/k permuted) with `llama.expert_count` and stacked experts;
    transformers' GGUF reader takes such a file for a dense Llama, so the reference is the HF model itself:
    equal logits from the F32 file, the quantized file within its rounding, and the same greedy tokens from F32."""
    hf = hf_model("mixtral", num_local_experts=4, num_experts_per_tok=2)
    path = write_gguf(tmp_path / f"mixtral-{qtype}.gguf", hf, qtype, byte_tokenizer()._tok)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    model = load_model(path, keep_quantized=True)
    assert model.config.architecture == "MixtralForCausalLM" and model.config.n_experts == 4
    assert _quant_layers(model) == ((4 + 4 * 3) * model.config.n_layers + 1 if qtype != "F32" else 0)
    _assert_like_hf(model, hf, ids, qtype)


GPT_OSS = dict(num_hidden_layers=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
               max_position_embeddings=256, attn_implementation="eager", rope_scaling={
                   "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                   "beta_slow": 1.0, "truncate": False})


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "MXFP4"])
def test_gpt_oss_loads_with_biases_sinks_windows_and_mxfp4_experts(tmp_path, qtype):
    """gpt-oss as convert_hf_to_gguf writes it (gate and up de-interleaved and transposed, biases stacked like the
    experts, sinks, YaRN); transformers' gpt-oss GGUF reader expects tensor names llama.cpp does not write, so the
    reference is the HF model: F32 logits equal past YaRN's original context, 24 greedy tokens; Q8_0 kept as blocks
    (experts per expert) and MXFP4 experts (dequantized) within their rounding."""
    hf = hf_model("gpt_oss", **GPT_OSS)
    model = load_model(write_gguf(tmp_path / f"gpt-oss-{qtype}.gguf", hf, qtype, byte_tokenizer()._tok),
                       keep_quantized=True)
    cfg = model.config
    assert cfg.architecture == "GptOssForCausalLM" and cfg.attention_sinks and cfg.rope_type == "yarn"
    assert [cfg.layer_window(i) for i in range(cfg.n_layers)] == [8, 0, 8, 0]
    # Q8_0: attention and every expert kept; MXFP4 (experts only, as gpt-oss ships): attention kept, experts dense.
    kept = {"F32": 0, "Q8_0": (4 + 4 * 3) * cfg.n_layers + 1, "MXFP4": 4 * cfg.n_layers + 1}
    assert _quant_layers(model) == kept[qtype]
    ids = torch.randint(0, VOCAB, (2, 100), generator=torch.Generator().manual_seed(3))  # past the original 64
    _assert_like_hf(model, hf, ids, qtype)


# Every matrix's rows a whole number of 32-value Q8_0 blocks (attn_k_b's are qk_nope_head_dim wide, attn_v_b's
# kv_lora_rank), so that no tensor falls back to F16 as the converter's would.
DEEPSEEK_V3 = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=32,
                   v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                   n_shared_experts=2, first_k_dense_replace=1, moe_intermediate_size=32, routed_scaling_factor=1.5,
                   max_position_embeddings=256, rope_scaling={
                       "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                       "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0})


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_deepseek_v3_loads_from_deepseek2_files(tmp_path, qtype):
    """DeepSeek-V3 (query LoRA, YaRN, a dense first layer, grouped sigmoid routing with a correction bias, shared
    experts) as convert_hf_to_gguf writes it: `deepseek2`, kv_b_proj split into `attn_k_b`/`attn_v_b`. transformers
    has no deepseek2 GGUF reader, so the reference is the HF model: F32 logits equal past YaRN's original context and
    24 greedy tokens; Q8_0 kept as blocks (each expert, the shared experts) within its rounding."""
    hf = hf_model("deepseek_v3", **DEEPSEEK_V3)
    model = load_model(write_gguf(tmp_path / f"deepseek2-{qtype}.gguf", hf, qtype, byte_tokenizer()._tok),
                       keep_quantized=True)
    cfg = model.config
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.mla and cfg.router == "sigmoid_grouped"
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (32, 32, 32, 8, 16)
    assert (cfg.n_expert_groups, cfg.topk_groups, cfg.n_shared_experts, cfg.routed_scaling) == (4, 2, 2, 1.5)
    assert [cfg.layer_is_moe(i) for i in range(cfg.n_layers)] == [False, True]
    # Kept: the 4 MLA projections (kv_b_proj stays dense for the absorbed form), the dense FFN's 3, each expert's 3,
    # the shared experts' 3 and the head.
    assert _quant_layers(model) == (4 * 2 + 3 + 8 * 3 + 3 + 1 if qtype != "F32" else 0)
    ids = torch.randint(0, VOCAB, (2, 100), generator=torch.Generator().manual_seed(3))  # past the original 64
    _assert_like_hf(model, hf, ids, qtype)


def test_deepseek2_files_with_a_whole_kv_b_load_too(tmp_path):
    """Older converters wrote kv_b_proj whole (`attn_kv_b`) and the heads' widths in key/value_length."""
    hf = hf_model("deepseek_v3", **DEEPSEEK_V3)
    model = load_model(write_gguf(tmp_path / "deepseek2-old.gguf", hf, tokenizer=byte_tokenizer()._tok,
                                  whole_kv_b=True))
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= LOGITS_ATOL


@pytest.mark.parametrize(("writes", "field"), [("add_kv_lora_rank", "deepseek2.attention.kv_lora_rank is missing"),
                                               ("add_expert_gating_func", "deepseek2.expert_gating_func is None")])
def test_deepseek2_without_a_needed_key_is_refused_by_name(tmp_path, monkeypatch, writes, field):
    """A file without kv_lora_rank, or without the gating function (llama.cpp then assumes DeepSeek-V2's softmax,
    which is not served), is refused naming the field."""
    monkeypatch.setattr(GGUFWriter, writes, lambda self, value: None)
    path = write_gguf(tmp_path / "deepseek2.gguf", hf_model("deepseek_v3", **DEEPSEEK_V3))
    with pytest.raises(ValueError, match=f"GGUF metadata {field}"):
        load_model(path)


def test_unpermute_inverts_llama_cpp_permutation():
    from gguf_helpers import permute

    w = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    assert torch.equal(torch.from_numpy(permute(w.numpy(), 8))[unpermute_index(8 * 16, 8)], w)
    assert not torch.equal(torch.from_numpy(permute(w.numpy(), 8)), w)


def _kquant_tensor(tmp_path, qtype: GGMLQuantizationType) -> GGUFCheckpoint:
    """A 2x512 tensor of random K-quant blocks whose f16 scales are set to small finite values."""
    block_bytes = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q5_K: 176, GGMLQuantizationType.Q6_K: 210}
    scale_at = {GGMLQuantizationType.Q4_K: (0, 4), GGMLQuantizationType.Q5_K: (0, 4),
                GGMLQuantizationType.Q6_K: (208, 210)}[qtype]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (4, block_bytes[qtype]), dtype=np.uint8)
    blocks[:, scale_at[0]:scale_at[1]] = np.full(((scale_at[1] - scale_at[0]) // 2,), 0.01, np.float16).view(np.uint8)
    writer = GGUFWriter(str(tmp_path / f"{qtype.name}.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", blocks.reshape(2, -1), raw_dtype=qtype)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    return GGUFCheckpoint.open(tmp_path / f"{qtype.name}.gguf")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_dequantize_to_the_tensor_shape(tmp_path, qtype):
    checkpoint = _kquant_tensor(tmp_path, GGMLQuantizationType[qtype])
    tensor = checkpoint.reader.tensors[0]
    weight = tensor_weight(tensor, torch.bfloat16)
    assert weight.shape == (2, 512) and weight.dtype == torch.bfloat16
    expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(2, 512))
    assert torch.equal(weight, expected.to(torch.bfloat16))
    assert 0 < weight.float().abs().max() < 100


def test_unsupported_tensor_type_is_refused_by_name(tmp_path):
    hf = hf_model("llama")
    path = write_gguf(tmp_path / "q5.gguf", hf, "Q5_0", byte_tokenizer()._tok)
    with pytest.raises(ValueError, match=r"tensor token_embd\.weight: GGUF type Q5_0 is not supported"):
        load_model(path)


def test_unsupported_architecture_and_tokenizer_are_refused_by_name(tmp_path):
    writer = GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["a"])
    writer.add_tensor("token_embd.weight", np.zeros((1, 32), np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    with pytest.raises(ValueError, match="GGUF architecture 'falcon' is not supported"):
        load_model(tmp_path / "falcon.gguf")
    with pytest.raises(ValueError, match="GGUF tokenizer model 'llama' is not supported"):
        TextTokenizer.from_dir(tmp_path)


def test_a_directory_with_two_gguf_files_is_ambiguous(tmp_path):
    hf = hf_model("llama")
    for name in ("a.gguf", "b.gguf"):
        write_gguf(tmp_path / name, hf)
    with pytest.raises(ValueError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        load_model(tmp_path)
    assert load_model(tmp_path / "b.gguf").config.n_layers == 2


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory):
    """The demo model's BPE tokenizer (4096 tokens, merges, <|endoftext|>) in a GGUF, with a ChatML template."""
    hf = hf_model("llama", vocab_size=4096)
    directory = tmp_path_factory.mktemp("demo-gguf")
    write_gguf(directory / "demo.gguf", hf, "Q8_0", Tokenizer.from_file(DEMO_TOKENIZER), CHATML, eos="<|endoftext|>")
    return directory


TEXTS = ["The with statement  opens a file.\n\n", "x = 12345 + 0.5  # héllo 日本", "<|endoftext|>after", " "]


def test_gguf_tokenizer_equals_the_original_and_transformers(demo_gguf):
    ours = TextTokenizer.from_dir(demo_gguf)
    original = Tokenizer.from_file(DEMO_TOKENIZER)
    theirs = transformers.AutoTokenizer.from_pretrained(demo_gguf, gguf_file="demo.gguf")
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == original.encode(text).ids == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.eos_token == "<|endoftext|>" and ours.eos_token_ids == (original.token_to_id("<|endoftext|>"),)
    assert ours.decode(ours.encode("a<|endoftext|>b")) == "ab"  # a control token is special


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2 = ?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 * 7?"}]


def _hf_chat_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _ours_chat_ids(tokenizer: TextTokenizer, messages) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def test_chat_ids_from_gguf_metadata_equal_transformers(demo_gguf):
    ours = TextTokenizer.from_dir(demo_gguf)
    theirs = transformers.AutoTokenizer.from_pretrained(demo_gguf, gguf_file="demo.gguf")
    assert ours.chat_template == CHATML
    for messages in (CONVERSATION, CONVERSATION[1:2]):
        assert _ours_chat_ids(ours, messages) == _hf_chat_ids(theirs, messages)


JINJA = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}" \
        "[assistant]{% endif %}"
CONFIG_TEMPLATE = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}ASSISTANT:"


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json", "both"])
def test_chat_template_order_matches_transformers(tmp_path, where):
    """chat_template.jinja first, then tokenizer_config.json: the same template transformers picks."""
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=DEMO_TOKENIZER, eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if where in ("tokenizer_config.json", "both"):
        config["chat_template"] = CONFIG_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if where in ("chat_template.jinja", "both"):
        (tmp_path / "chat_template.jinja").write_text(JINJA)
    ours = TextTokenizer.from_dir(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.chat_template == (CONFIG_TEMPLATE if where == "tokenizer_config.json" else JINJA)
    assert _ours_chat_ids(ours, CONVERSATION) == _hf_chat_ids(theirs, CONVERSATION)


def test_a_jinja_file_beside_a_gguf_overrides_its_metadata(demo_gguf, tmp_path):
    (tmp_path / "demo.gguf").symlink_to(demo_gguf / "demo.gguf")
    (tmp_path / "chat_template.jinja").write_text(JINJA)
    assert TextTokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION[1:2]) == "[user] 2 + 2 = ?\n[assistant]"


def test_no_chat_template_is_failed_precondition_never_a_guess(tmp_path):
    import grpc

    from genserve.services.common.errors import to_status
    from genserve.services.text.app import TextGeneration

    path = write_gguf(tmp_path / "plain.gguf", hf_model("llama"), tokenizer=byte_tokenizer()._tok)
    tokenizer = TextTokenizer.from_dir(path)
    assert tokenizer.chat_template is None and tokenizer.encode("hi") == [104, 105]
    with pytest.raises(NoChatTemplate) as raised:
        tokenizer.apply_chat_template(CONVERSATION)
    status = to_status(raised.value, "rid", TextGeneration.func_or_class.known_errors)
    assert status.code == grpc.StatusCode.FAILED_PRECONDITION
    assert status.details.startswith("messages: this model has no chat template")


def test_int8_and_bfloat16_serving_of_a_gguf_file(tmp_path):
    hf = hf_model("qwen2")
    path = write_gguf(tmp_path / "q8.gguf", hf, "Q8_0")
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = load_model(path)(ids)
        for dtype, atol in (("int8", 0.05), ("bfloat16", 0.05)):
            model = load_model(path, dtype)
            assert model.config.dtype == dtype
            assert (model(ids).float() - reference).abs().max().item() < atol


def test_pre_tokenizers_split_digits_as_llama_cpp_names_them():
    from genserve.services.text.gguf_tokenizer import pre_tokenizer

    def words(name: str, text: str) -> list[str]:
        return [w for w, _ in pre_tokenizer(name).pre_tokenize_str(text)]

    assert words("smollm", "x 2024") == ["x", "Ġ", "2", "0", "2", "4"]
    assert words("gpt-2", "x 2024") == ["x", "Ġ2024"]
    assert words("llama-bpe", "x 2024") == ["x", "Ġ", "202", "4"]
    assert words("qwen2", "x 2024") == ["x", "Ġ", "2", "0", "2", "4"]
    with pytest.raises(ValueError, match="GGUF pre-tokenizer 'tekken' is not supported"):
        pre_tokenizer("tekken")


def test_bos_is_added_when_the_metadata_asks():
    from genserve.services.text.gguf_tokenizer import gguf_tokenizer

    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["<s>", "a", "b", "ab"],
                "tokenizer.ggml.token_type": [3, 1, 1, 1], "tokenizer.ggml.merges": ["a b"],
                "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.add_bos_token": True}
    tokenizer, config = gguf_tokenizer(metadata)
    assert config["bos_token"] == "<s>" and tokenizer.encode("abab").ids == [0, 3, 3]
    assert tokenizer.encode("ab", add_special_tokens=False).ids == [3]
