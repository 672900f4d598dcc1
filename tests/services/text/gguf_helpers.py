"""Tiny GGUF files written with gguf.GGUFWriter the way llama.cpp's convert_hf_to_gguf.py writes them: Llama and
Mistral as the `llama` architecture with q/k rows permuted, Qwen2, Qwen3 and Phi-3 unpermuted (Phi-3's fused
projections as they are, its longrope factors as two tensors), Gemma 2 and 3 with every norm gain stored as 1 + w,
DeepSeek-V3 as `deepseek2` (MLA as MQA over the latent, kv_b_proj split per head into `attn_k_b`, transposed, and
`attn_v_b`; or whole, as older converters wrote it); 1-D tensors in F32, the matrices in the asked type; a byte-level
BPE tokenizer (vocabulary, merges, control tokens) and a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter, RopeScalingType, TokenType
from gguf.quants import quantize
from tokenizers import Tokenizer

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "qwen3_moe": "qwen3moe", "mixtral": "llama", "gpt_oss": "gpt-oss", "gemma2": "gemma2",
             "gemma3_text": "gemma3", "deepseek_v3": "deepseek2"}
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused projections
    "mlp.gate": "ffn_gate_inp",  # a MoE router
}
GPT_OSS_LAYER = LAYER | {"post_attention_layernorm": "post_attention_norm", "self_attn.sinks": "attn_sinks",
                         "mlp.router": "ffn_gate_inp"}
DEEPSEEK2_LAYER = LAYER | {
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}
GEMMA_LAYER = LAYER | {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                       "post_feedforward_layernorm": "post_ffw_norm"}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def gguf_name(name: str, arch: str = "llama") -> str:
    if name in HF_TO_GGUF:
        return HF_TO_GGUF[name]
    if name.startswith("blk."):  # already a GGUF name (_stacked_experts)
        return name
    _, _, layer, rest = name.split(".", 3)
    if rest == "self_attn.sinks":
        return f"blk.{layer}.attn_sinks.weight"
    if rest == "mlp.gate.e_score_correction_bias":  # renamed e_score_correction.bias by the converter
        return f"blk.{layer}.exp_probs_b.bias"
    module, kind = rest.rsplit(".", 1)
    names = GEMMA_LAYER if arch.startswith("gemma") else GPT_OSS_LAYER if arch == "gpt-oss" else \
        DEEPSEEK2_LAYER if arch == "deepseek2" else LAYER
    return f"blk.{layer}.{names[module]}.{kind}"


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: HF's rotary halves -> llama.cpp's interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_tokenizer(writer: GGUFWriter, tokenizer: Tokenizer, pre: str = "gpt-2", eos: str | None = None) -> None:
    """A byte-level BPE tokenizer as llama.cpp stores it: tokens by id, merges, added tokens as CONTROL."""
    spec = json.loads(tokenizer.to_str())
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    if merges:
        writer.add_token_merges(merges)
    if eos is not None:
        writer.add_eos_token_id(vocab[eos])
    writer.add_add_bos_token(False)


def _stacked_experts(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The state with a MoE layer's experts as llama.cpp stacks them: transformers' fused gate_up_proj (E, 2I, dim),
    gate rows first, becomes `ffn_gate_exps` and `ffn_up_exps` (E, I, dim); down_proj (E, dim, I) `ffn_down_exps`.
    Their names are returned as GGUF names already, the rest as HF names."""
    out = []
    for name, tensor in state.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        if name.endswith("mlp.experts.gate_up_proj") and f"{name}_bias" in state:
            # gpt-oss: (E, dim, 2I), gate and up interleaved by column; down_proj (E, I, dim): x @ W layouts
            out += [(f"blk.{layer}.ffn_gate_exps.weight", tensor[:, :, 0::2].transpose(1, 2)),
                    (f"blk.{layer}.ffn_up_exps.weight", tensor[:, :, 1::2].transpose(1, 2))]
        elif name.endswith("mlp.experts.gate_up_proj_bias"):
            out += [(f"blk.{layer}.ffn_gate_exps.bias", tensor[:, 0::2]), (f"blk.{layer}.ffn_up_exps.bias",
                                                                          tensor[:, 1::2])]
        elif name.endswith("mlp.experts.down_proj_bias"):
            out.append((f"blk.{layer}.ffn_down_exps.bias", tensor))
        elif name.endswith("mlp.experts.down_proj") and f"{name}_bias" in state:
            out.append((f"blk.{layer}.ffn_down_exps.weight", tensor.transpose(1, 2)))
        elif name.endswith("mlp.experts.gate_up_proj"):
            layer = name.split(".")[2]
            gate, up = tensor.chunk(2, dim=1)
            out += [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]
        elif name.endswith("mlp.experts.down_proj"):
            out.append((f"blk.{name.split('.')[2]}.ffn_down_exps.weight", tensor))
        else:
            out.append((name, tensor))
    return out


def _split_kv_b(state: dict[str, torch.Tensor], n_heads: int, nope: int) -> dict[str, torch.Tensor]:
    """DeepseekV2Model.modify_tensors: kv_b_proj (H (nope + v), kv_lora) -> `attn_k_b` (H, kv_lora, nope), each
    head's key rows transposed, and `attn_v_b` (H, v, kv_lora), under GGUF names; the rest unchanged."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("self_attn.kv_b_proj.weight"):
            layer = name.split(".")[2]
            k_b, v_b = tensor.view(n_heads, -1, tensor.shape[-1]).split([nope, tensor.shape[0] // n_heads - nope], 1)
            out |= {f"blk.{layer}.attn_k_b.weight": k_b.transpose(1, 2), f"blk.{layer}.attn_v_b.weight": v_b}
        else:
            out[name] = tensor
    return out


def _deepseek2_metadata(writer: GGUFWriter, cfg, whole_kv_b: bool) -> None:
    """convert_hf_to_gguf's DeepseekV2Model (and TextModel's MoE keys): MLA as MQA over the latent, whose widths are
    key/value_length; the heads' own in the _mla keys (older converters: in key/value_length, no _mla keys)."""
    rope = cfg.rope_parameters
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    head_k = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    writer.add_key_length(head_k if whole_kv_b else cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.v_head_dim if whole_kv_b else cfg.kv_lora_rank)
    if not whole_kv_b:
        writer.add_key_length_mla(head_k)
        writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_group_count(cfg.n_group)
    writer.add_expert_group_used_count(cfg.topk_group)
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)  # DeepSeek-V3's config.json: scoring_func sigmoid
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    writer.add_expert_weights_norm(cfg.norm_topk_prob)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    writer.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
    writer.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
    writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def write_gguf(path: Path, hf: torch.nn.Module, qtype: str = "F32", tokenizer: Tokenizer | None = None,
               chat_template: str | None = None, eos: str | None = None, pre: str = "gpt-2",
               whole_kv_b: bool = False) -> Path:
    cfg = hf.config
    arch = GGUF_ARCH[cfg.model_type]
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(1 if arch == "deepseek2" else cfg.num_key_value_heads)  # MLA: one latent "head"
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3: the global layers' RoPE
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type", "default") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if rope.get("rope_type") == "longrope":  # as convert_hf_to_gguf's Phi3MiniModel writes it
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], dtype=np.float32))
    writer.add_vocab_size(cfg.vocab_size)
    if arch in ("qwen3", "qwen3moe", "gpt-oss", "gemma2", "gemma3"):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen3moe", "gpt-oss"):  # Mixtral's experts are feed_forward_length wide
        writer.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    if arch == "gpt-oss":
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg.sliding_window)
        if cfg.attn_logit_softcapping:
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "deepseek2":
        _deepseek2_metadata(writer, cfg, whole_kv_b)
    if arch == "gemma3":
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if tokenizer is not None:
        add_tokenizer(writer, tokenizer, pre, eos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    state = hf.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if arch == "deepseek2" and not whole_kv_b:
        state = _split_kv_b(state, cfg.num_key_value_heads, cfg.qk_nope_head_dim)
    for name, tensor in _stacked_experts(state):
        target = gguf_name(name, arch)
        data = tensor.detach().float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's Gemma norms multiply by the stored gain
        kind = target.split(".")[-2]
        if arch == "llama" and kind in heads:
            data = permute(data, heads[kind])
        if data.ndim >= 2 and qtype != "F32" and kind != "ffn_gate_inp" and target.endswith(".weight"):
            # llama-quantize keeps routers in F32; MXFP4 is for experts only, as in gpt-oss's own files
            raw = GGMLQuantizationType[qtype if qtype != "MXFP4" or "_exps" in kind else "Q8_0"]
            writer.add_tensor(target, quantize(data, raw), raw_dtype=raw)
        else:
            writer.add_tensor(target, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
