"""GGUF checkpoints (llama.cpp's format), read with the `gguf` package (llama.cpp's own reader).

A `.gguf` file, or a directory holding one, gives the model config (from the `<arch>.*` metadata), the weights under
Hugging Face names, and the tokenizer and chat template (services/text/gguf_tokenizer.py). Architectures: `llama`
(Llama and Mistral, which llama.cpp converts as `llama`), `qwen2`, `qwen3`, `phi3`, `gemma2` and `gemma3`. Phi-3's
fused `attn_qkv` (q, k, v rows) and `ffn_up` (gate rows, then up rows) are split by rows, kept-quantized ones as
whole rows of blocks; its longrope factors come from the `rope_factors_long`/`rope_factors_short` tensors and
`phi3.rope.scaling.original_context_length`. `qwen3moe` stacks each layer's experts in one tensor per projection
(`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`: expert e is slice e), served per expert, kept-quantized ones as
the expert's own blocks; its top-k weights are renormalised, as llama.cpp's qwen3moe graph always does. Mixtral is
a `llama` file with `llama.expert_count` and the same stacked experts. `gpt-oss` adds biases (the experts' stacked
too), a sink logit per head, MXFP4 experts and YaRN with the betas llama.cpp assumes; its even layers slide.
`deepseek2` (DeepSeek-V3) is multi-head latent attention as llama.cpp serves it, MQA over the latent: its
`attention.key_length`/`value_length` are the latent's widths, the heads' own are `key_length_mla`/`value_length_mla`
(older files: `key_length`/`value_length`, and a whole `attn_kv_b`); the converter splits `kv_b_proj` into
`attn_k_b` (each head's key rows transposed) and `attn_v_b`, joined here again (`merged_kv_b`) and served dense, as the
absorbed attention reads it (shared/blocks/mla.py). Its RoPE pairs are interleaved, unpermuted (llama.cpp's NORM
rope, HF's rope_interleave); routing is sigmoid with the `exp_probs_b` correction bias, grouped when the file has
`expert_group_count` (else one group, as llama.cpp then routes), and YaRN's softmax scale comes from
`rope.scaling.yarn_log_multiplier` (0.1 mscale_all_dim). For Gemma,
llama.cpp's converter stores every RMSNorm gain as 1 + w (its norms multiply by the gain), so 1 is taken off again;
what its runtime hard-codes, our config states: the softmax scale 1/sqrt(key_length), the sliding layers' RoPE base
10,000 (Gemma 3) and Gemma 2's alternating windows. `tensor_weight` dequantizes a tensor to the
served dtype; with ``keep_quantized``, `GGUFCheckpoint.quantized_linears` instead hands the projection matrices
stored as Q8_0/Q4_0/Q4_1 to the loader as the file's own blocks (shared/blocks/quant_linear.py), never as floats.

llama.cpp's converter permutes the rows of `attn_q`/`attn_k` for the `llama` architecture (its rotary pairs are
interleaved, HF's are the two halves of each head); `unpermute_index` undoes that. `qwen2` files are not permuted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from genserve.services.text.config import LlamaConfig
from genserve.services.text.gguf_file import GGUFFile, GGUFTensor
from genserve.services.text.hf_weights import FUSED_PROJECTIONS, fused_rows, to_model_names
from genserve.shared.blocks.backend import Backend

SUFFIX = ".gguf"
# GGUF `general.architecture` -> (our architecture name, q/k rows permuted by llama.cpp, q/k/v biases)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True, False),
    "mistral": ("MistralForCausalLM", True, False),
    "qwen2": ("Qwen2ForCausalLM", False, True),
    "qwen3": ("Qwen3ForCausalLM", False, False),
    "phi3": ("Phi3ForCausalLM", False, False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False, False),
    "gpt-oss": ("GptOssForCausalLM", False, True),
    "gemma2": ("Gemma2ForCausalLM", False, False),
    "gemma3": ("Gemma3ForCausalLM", False, False),
    "deepseek2": ("DeepseekV3ForCausalLM", False, False),
}
GEMMA = ("gemma2", "gemma3")
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa for Gemma 3
Q = GGMLQuantizationType
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4})
# Served as the file's own blocks (QuantLinear) when kept quantized; K-quants are dequantized.
KEPT_QUANTIZED = frozenset({Q.Q8_0, Q.Q4_0, Q.Q4_1})
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a MoE layer's router
}
# gpt-oss: biases everywhere, a sink logit per head, and the norm before the FFN under llama.cpp's post-attention name.
GPT_OSS_LAYER_NAMES = LAYER_NAMES | {
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.bias": "mlp.gate.bias",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
}
# A MoE layer's experts, stacked (E, rows, cols) in one tensor each (their biases (E, rows)): expert e is slice e.
EXPERT_NAMES = {f"ffn_{kind}_exps.{part}": f"{kind}_proj.{part}" for kind in ("gate", "up", "down")
                for part in ("weight", "bias")}
GPT_OSS_ROPE = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}  # what llama.cpp's gpt-oss graph assumes
# Phi-3's fused projections, under HF's fused names (split by hf_weights.to_model_names).
PHI3_LAYER_NAMES = LAYER_NAMES | {"attn_qkv.weight": "self_attn.qkv_proj.weight",
                                  "ffn_up.weight": "mlp.gate_up_proj.weight"}
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # longrope's factors, not weights
# Gemma's four norms: llama.cpp's ffn_norm is the one before the FFN, as for Llama, but HF names it apart.
GEMMA_LAYER_NAMES = LAYER_NAMES | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# DeepSeek-V3: MLA's projections (attn_q without a query LoRA), the router's correction bias, one shared-experts
# FFN (ours is the first of a list); `attn_kv_b` is the whole kv_b_proj of older files.
DEEPSEEK2_LAYER_NAMES = LAYER_NAMES | {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
} | {f"ffn_{kind}_shexp.weight": f"mlp.shared_experts.0.{kind}_proj.weight" for kind in ("gate", "up", "down")}
# The current converter's halves of kv_b_proj (merged_kv_b).
KV_B_HALVES = ("attn_k_b", "attn_v_b")
SIGMOID_GATING = 2  # llama.cpp's expert_gating_func: 1 softmax (assumed when absent), 2 sigmoid
# The architectures whose layer tensors are named otherwise than LAYER_NAMES.
ARCH_LAYER_NAMES = {"phi3": PHI3_LAYER_NAMES, "gpt-oss": GPT_OSS_LAYER_NAMES, "gemma2": GEMMA_LAYER_NAMES,
                    "gemma3": GEMMA_LAYER_NAMES, "deepseek2": DEEPSEEK2_LAYER_NAMES}


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file that `path` names: the file itself, or the one `.gguf` in a directory without `config.json`;
    None for a Hugging Face directory. Several `.gguf` files in one directory are refused (which one?)."""
    path = Path(path)
    if path.is_file():
        if path.suffix != SUFFIX:
            raise ValueError(f"{path} is not a {SUFFIX} file; give a .gguf file or a model directory")
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path} not found: give a .gguf file or a model directory")
    if (path / "config.json").exists():
        return None
    files = sorted(path.glob(f"*{SUFFIX}"))
    if len(files) > 1:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(f.name for f in files)}); name one")
    return files[0] if files else None


def tensor_weight(tensor: GGUFTensor, dtype: torch.dtype) -> torch.Tensor:
    """What one GGUF tensor becomes in the model: its values in `dtype`, in torch's (out, in) layout.

    The single per-tensor decision of the loader; every supported type is dequantized (gguf.quants) today.
    """
    if tensor.tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(f"tensor {tensor.name}: GGUF type {tensor.tensor_type.name} is not supported "
                         f"(supported: {supported})")
    values = dequantize(tensor.data, tensor.tensor_type)  # float32, numpy order: (ne[n-1], ..., ne[0])
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).reshape(shape).to(dtype)


def unpermute_index(rows: int, n_heads: int) -> torch.Tensor:
    """The row order that undoes convert_hf_to_gguf's `permute`: within each head, rows go from llama.cpp's
    interleaved rotary pairs (i, half) back to HF's halves (half, i). New row i is the file's row index[i], for a
    weight (rows, in), a bias (rows,) or rows of quantized blocks alike."""
    return torch.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).transpose(1, 2).reshape(-1)


def merged_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """DeepSeek's kv_b_proj (H (nope + v), kv_lora) from llama.cpp's halves: `attn_k_b` (H, kv_lora, nope), each
    head's key rows stored transposed, and `attn_v_b` (H, v, kv_lora); each head's key rows, then its value rows."""
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).flatten(0, 1)


def expert_names(name: str, n_experts: int) -> list[str] | None:
    """`blk.3.ffn_up_exps.weight` -> the HF names of each expert's slice (`model.layers.3.mlp.experts.{e}.up_proj
    .weight`); None for a tensor that holds no experts."""
    parts = name.split(".", 2)
    if len(parts) != 3 or parts[2] not in EXPERT_NAMES:
        return None
    return [f"model.layers.{parts[1]}.mlp.experts.{e}.{EXPERT_NAMES[parts[2]]}" for e in range(n_experts)]


def hf_name(name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; an unknown tensor is refused by name."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    layer_names = ARCH_LAYER_NAMES.get(arch, LAYER_NAMES)
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    raise ValueError(f"GGUF tensor {name!r} is not part of a {arch} decoder")


@dataclass
class GGUFCheckpoint:
    """One opened GGUF file: its metadata (key -> value) and tensors, read lazily from a memory map."""

    path: Path
    reader: GGUFFile
    metadata: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        reader = GGUFFile(path)
        return cls(Path(path), reader, reader.metadata)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
        return arch

    @property
    def file_type(self) -> str:
        """The most common tensor type, e.g. "Q4_1" (GGUF's own `general.file_type` is an enum of mixes)."""
        types = [t.tensor_type.name for t in self.reader.tensors if len(t.shape) == 2]
        return max(set(types), key=types.count) if types else "F32"

    def _arch_value(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(f"{self.architecture}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata {self.architecture}.{key} is missing")
        return value

    def config(self) -> LlamaConfig:
        arch = self.architecture
        name, _, qkv_bias = ARCHITECTURES[arch]
        if arch == "llama" and f"{arch}.expert_count" in self.metadata:
            name = "MixtralForCausalLM"  # llama.cpp converts Mixtral as `llama` with experts
        n_heads = int(self._arch_value("attention.head_count"))
        dim = int(self._arch_value("embedding_length"))
        embed = next((t for t in self.reader.tensors if t.name == "token_embd.weight"), None)
        if embed is None:
            raise ValueError(f"{self.path.name} has no token_embd.weight tensor")
        eos = self.metadata.get("tokenizer.ggml.eos_token_id")
        config = LlamaConfig(
            vocab_size=int(embed.shape[1]), dim=dim, n_layers=int(self._arch_value("block_count")),
            n_heads=n_heads, n_kv_heads=int(self._arch_value("attention.head_count_kv", n_heads)),
            head_dim=int(self._arch_value("attention.key_length", dim // n_heads)),
            ffn_hidden=int(self._arch_value("feed_forward_length")),
            rope_theta=float(self._arch_value("rope.freq_base", 10000.0)),
            rope_scaling=tuple(sorted(self._rope_scaling().items())),
            max_position=int(self._arch_value("context_length")),
            sliding_window=int(self._arch_value("attention.sliding_window", 0)),
            norm_eps=float(self._arch_value("attention.layer_norm_rms_epsilon")),
            qkv_bias=qkv_bias,
            tie_embeddings=not any(t.name == "output.weight" for t in self.reader.tensors),
            bos_token_id=self.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            architecture=name,
        )
        return config.replace(**self._family(config))

    def _rope_scaling(self) -> dict[str, Any]:
        """rope_scaling as HF writes it: linear, YaRN (gpt-oss, deepseek2) or Phi-3's longrope; {} for none."""
        arch = self.architecture
        scaling = self.metadata.get(f"{arch}.rope.scaling.type", "none")
        if scaling == "none":
            return self._longrope()
        if scaling not in ("linear", "yarn") or (scaling == "yarn" and arch not in ("gpt-oss", "deepseek2")):
            raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (supported: none, linear; yarn for "
                             "gpt-oss and deepseek2)")
        out = {"rope_type": scaling, "factor": float(self._arch_value("rope.scaling.factor"))}
        if scaling == "linear":
            return out
        out["original_max_position_embeddings"] = int(self._arch_value("rope.scaling.original_context_length"))
        if arch == "gpt-oss":
            return out | GPT_OSS_ROPE
        # deepseek2: llama.cpp's graph keeps the rotated parts' magnitude (attention factor 1) and scales the
        # softmax by YaRN's mscale of mscale_all_dim, which the converter stores times 0.1. Its yarn_attn_factor
        # would scale both again, which HF's DeepSeek does not: not served.
        if float(self._arch_value("rope.scaling.yarn_attn_factor", 1.0)) != 1.0:
            raise ValueError("GGUF metadata deepseek2.rope.scaling.yarn_attn_factor: only 1 is served")
        return out | {"beta_fast": float(self._arch_value("rope.scaling.yarn_beta_fast", 32.0)),
                      "beta_slow": float(self._arch_value("rope.scaling.yarn_beta_slow", 1.0)),
                      "attention_factor": 1.0,
                      "mscale_all_dim": float(self._arch_value("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1}

    def _longrope(self) -> dict[str, Any]:
        """Phi-3's longrope (rope_scaling as HF writes it) from its factor tensors; {} for a file without them."""
        factors = {t.name: t for t in self.reader.tensors if t.name in ROPE_FACTORS}
        if not factors:
            return {}
        if len(factors) != 2:
            raise ValueError(f"{self.path.name}: longrope needs both {' and '.join(ROPE_FACTORS)}")
        return {"rope_type": "longrope",
                "long_factor": tuple(tensor_weight(factors["rope_factors_long.weight"], torch.float64).tolist()),
                "short_factor": tuple(tensor_weight(factors["rope_factors_short.weight"], torch.float64).tolist()),
                "original_max_position_embeddings": int(self._arch_value("rope.scaling.original_context_length"))}

    def _experts(self, width: str) -> dict[str, Any]:
        """A MoE file's experts: their count, how many a token uses, their width (metadata key ``width``); the
        top-k weights renormalised, as llama.cpp's MoE graphs for these architectures do."""
        return {"n_experts": int(self._arch_value("expert_count")),
                "n_experts_per_token": int(self._arch_value("expert_used_count")),
                "moe_hidden": int(self._arch_value(width)), "norm_topk_prob": True}

    def _family(self, config: LlamaConfig) -> dict[str, Any]:
        """What qwen3 and Gemma files set beyond the Llama fields (module docstring)."""
        arch = self.architecture
        if arch == "qwen3":
            return {"qk_norm": True}
        if arch == "deepseek2":
            return self._deepseek2(config)
        if arch == "gpt-oss":
            n = config.n_layers  # llama.cpp's swa pattern 2: the even layers slide
            return {"attention_sinks": True, "o_bias": True, "router_bias": True, "expert_bias": True,
                    "hidden_act": "swiglu_clamped", "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                    **self._experts("expert_feed_forward_length"),
                    "layer_types": tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n))
                    if config.sliding_window else ()}
        if arch in ("qwen3moe", "llama") and f"{arch}.expert_count" in self.metadata:
            # Mixtral's experts are feed_forward_length wide
            width = "expert_feed_forward_length" if arch == "qwen3moe" else "feed_forward_length"
            return {"qk_norm": arch == "qwen3moe", **self._experts(width)}
        if arch not in GEMMA:
            return {}
        out: dict[str, Any] = dict(
            norm_unit_offset=True, sandwich_norm=True, embed_scale=True, hidden_act="gelu_tanh",
            query_pre_attn_scalar=float(config.head_dim),
            attn_softcap=float(self.metadata.get(f"{arch}.attn_logit_softcapping") or 0.0),
            final_softcap=float(self.metadata.get(f"{arch}.final_logit_softcapping") or 0.0))
        n = config.n_layers
        if arch == "gemma2":
            sliding = [i % 2 == 0 for i in range(n)]
        else:
            out.update(qk_norm=True, rope_local_theta=GEMMA3_LOCAL_ROPE_BASE)
            pattern = self.metadata.get(f"{arch}.attention.sliding_window_pattern", 6)
            sliding = [bool(p) for p in pattern] if isinstance(pattern, list) else \
                [i % int(pattern) < int(pattern) - 1 for i in range(n)]
        if config.sliding_window and len(sliding) == n:
            out["layer_types"] = tuple("sliding_attention" if s else "full_attention" for s in sliding)
        return out

    def _deepseek2(self, config: LlamaConfig) -> dict[str, Any]:
        """DeepSeek-V3's MLA and routing (module docstring); the heads' own widths, every head its own keys."""
        gating = self.metadata.get("deepseek2.expert_gating_func")
        if gating != SIGMOID_GATING:
            raise ValueError(f"GGUF metadata deepseek2.expert_gating_func is {gating}: only DeepSeek-V3's sigmoid "
                             f"routing ({SIGMOID_GATING}) is served, not DeepSeek-V2's softmax (1, which llama.cpp "
                             "assumes when the key is absent)")
        mla = "deepseek2.attention.key_length_mla" in self.metadata  # else an older file: the heads' widths
        key = int(self._arch_value("attention.key_length_mla" if mla else "attention.key_length"))
        rope = int(self._arch_value("rope.dimension_count"))
        groups = int(self._arch_value("expert_group_count", 1))
        return {**self._experts("expert_feed_forward_length"), "router": "sigmoid_grouped",
                "norm_topk_prob": bool(self._arch_value("expert_weights_norm", False)),
                "routed_scaling": float(self._arch_value("expert_weights_scale", 0.0)) or 1.0,
                "n_shared_experts": int(self._arch_value("expert_shared_count")),
                "first_dense_layers": int(self._arch_value("leading_dense_block_count", 0)),
                "n_expert_groups": groups, "topk_groups": int(self._arch_value("expert_group_used_count", groups)),
                "q_lora_rank": int(self._arch_value("attention.q_lora_rank", 0)),
                "kv_lora_rank": int(self._arch_value("attention.kv_lora_rank")),
                "qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope, "head_dim": key,
                "v_head_dim": int(self._arch_value("attention.value_length_mla" if mla else "attention.value_length")),
                "n_kv_heads": config.n_heads, "rope_interleaved": True}

    def _row_order(self, config: LlamaConfig, tensor: GGUFTensor, module: str = "") -> torch.Tensor | None:
        """The rows of ``tensor`` that make ``module``: its part of a fused Phi-3 projection, or llama.cpp's q/k
        permutation undone; None for a tensor taken whole, as stored."""
        kind = tensor.name.split(".")[-2]
        fused = hf_name(tensor.name, self.architecture).split(".")[-2] if self.architecture == "phi3" else ""
        if fused in FUSED_PROJECTIONS:
            start, size = fused_rows(fused, config)[module.rsplit(".", 1)[-1]]
            return torch.arange(start, start + size)
        heads = {"attn_q": config.n_heads, "attn_k": config.n_kv_heads}.get(kind)
        if heads is None or not ARCHITECTURES[self.architecture][1]:
            return None
        return unpermute_index(int(tensor.shape[-1]), heads)

    def quantized_linears(self) -> dict[str, GGUFTensor]:
        """The projection matrices (and the LM head) stored as Q8_0/Q4_0/Q4_1, by the HF name of their module
        (``model.layers.0.self_attn.q_proj``, ``lm_head``); a tied head reads the embedding's blocks."""
        kept = {}
        for tensor in self.reader.tensors:
            if tensor.tensor_type not in KEPT_QUANTIZED or not tensor.name.endswith(".weight"):
                continue
            if tensor.name.split(".")[-2] in KV_B_HALVES:  # merged into kv_b_proj, which MLA reads as a matrix
                continue
            experts = expert_names(tensor.name, int(tensor.shape[-1]))
            if experts is not None:  # each expert its own layer over its slice (quant_linear)
                kept.update((e.removesuffix(".weight"), tensor) for e in experts)
                continue
            name = hf_name(tensor.name, self.architecture).removesuffix(".weight")
            prefix, _, module = name.rpartition(".")
            if name == "model.embed_tokens":  # a lookup table stays dense; a tied head keeps its blocks
                if not any(t.name == "output.weight" for t in self.reader.tensors):
                    kept["lm_head"] = tensor
            elif module in FUSED_PROJECTIONS:  # Phi-3: each part its own rows (_row_order)
                kept.update((f"{prefix}.{part}", tensor) for part in FUSED_PROJECTIONS[module])
            elif name != "model.norm" and not name.endswith(("layernorm", ".mlp.gate")):  # a router is read whole
                kept[name] = tensor
        return kept

    def state_dict(self, config: LlamaConfig, dtype: torch.dtype, skip: frozenset[str] = frozenset()
                   ) -> dict[str, torch.Tensor]:
        """Every tensor under its HF name, in `dtype`, with llama.cpp's q/k row permutation undone; tensors named in
        `skip` (GGUF names, kept quantized by the caller) are not dequantized."""
        state = {}
        halves: dict[str, dict[str, torch.Tensor]] = {}  # DeepSeek's kv_b_proj, by layer
        for tensor in self.reader.tensors:
            if tensor.name in skip or tensor.name in ROPE_FACTORS:
                continue
            weight = tensor_weight(tensor, dtype)
            parts = tensor.name.split(".")  # blk.{layer}.{kind}.weight
            if parts[-2] in KV_B_HALVES:
                halves.setdefault(parts[1], {})[parts[-2]] = weight
                continue
            if self.architecture in GEMMA and tensor.name.endswith("norm.weight"):
                weight = weight - 1  # llama.cpp stores Gemma's gains as 1 + w
            experts = expert_names(tensor.name, weight.shape[0])
            if experts is not None:
                state.update(zip(experts, weight.unbind(0), strict=True))
                continue
            rows = None if self.architecture == "phi3" else self._row_order(config, tensor)
            state[hf_name(tensor.name, self.architecture)] = weight if rows is None else weight[rows]
        for layer, pair in halves.items():
            if len(pair) != len(KV_B_HALVES):
                raise ValueError(f"{self.path.name}: layer {layer} has {' and '.join(pair)} without its other half "
                                 f"({' and '.join(KV_B_HALVES)} make kv_b_proj)")
            state[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = merged_kv_b(*(pair[k] for k in KV_B_HALVES))
        return to_model_names(state, config) if self.architecture == "phi3" else state

    def quant_linear(self, config: LlamaConfig, tensor: GGUFTensor, bias: torch.Tensor | None,
                     backend: Backend, module: str = "") -> torch.nn.Module:
        """A QuantLinear over `tensor`'s own blocks for `module` (``quantized_linears``' key), its rows in HF order
        (its part of a fused tensor); `bias` (HF order) is added after."""
        from genserve.shared.blocks.quant_linear import QuantLinear

        data = tensor.data
        if expert_names(tensor.name, 1) is not None:  # (E, rows, row bytes): this module's expert is slice e
            data = data[int(module.split(".experts.")[1].split(".")[0])]
        out_features, in_features = (int(n) for n in reversed(tensor.shape.tolist()[:2]))
        if bias is not None and bias.numel() != out_features:
            raise ValueError(f"{module}: a bias on part of the fused tensor {tensor.name} is not supported")
        layer = QuantLinear.from_gguf(tensor.tensor_type, data, (out_features, in_features), bias, backend)
        rows = self._row_order(config, tensor, module)
        if rows is not None:
            layer = layer.select_rows(rows)
            if bias is not None:  # already in HF order: select_rows moved it with the file's rows
                layer.bias.data.copy_(bias)
        return layer
