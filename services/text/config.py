"""The decoder config, and its translation from/to Hugging Face ``config.json`` files.

One frozen dataclass describes every decoder the text service runs: Llama, Mistral (sliding window), Qwen2
(q/k/v biases, tied embeddings), Qwen3 (QK-norm) and Qwen3-MoE, Mixtral, Gemma 2 and 3 (soft-capping, (1 + w)
norms around both sublayers, per-layer windows and RoPE bases), Phi-3 (longrope; its fused projections are split at
load), DeepSeek-V3 (multi-head latent attention, grouped sigmoid routing, shared experts), gpt-oss (attention sinks,
biased experts with a clamped SwiGLU), and our own models with the options of the chapter "Deep Learning Building
Blocks" (gated attention, Definition 18 "Gated Attention"; parallel block, Definition 21 "Parallel Transformer Block";
mixture-of-experts FFN). ``from_hf`` accepts both the transformers 4.x spelling (top-level ``rope_theta``/
``rope_scaling``, ``torch_dtype``) and the 5.x one (``rope_parameters``, ``dtype``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                 "Phi3ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM")
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
               "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text", "Phi3ForCausalLM": "phi3",
               "DeepseekV3ForCausalLM": "deepseek_v3", "GptOssForCausalLM": "gpt_oss"}
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_tanh", "swiglu_clamped")
ROUTERS = ("softmax", "sigmoid_grouped")
# The chapter's options (module docstring) have no HF equivalent; checkpoints using them carry this architecture name.
GENSERVE_ARCHITECTURE = "GenserveForCausalLM"
REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True)
class LlamaConfig:
    # sizes
    vocab_size: int = 32000
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 8
    head_dim: int = 0  # 0 -> dim // n_heads
    ffn_hidden: int = 1376
    # positions
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # HF rope_scaling dict as sorted items (hashable, frozen)
    max_position: int = 2048
    sliding_window: int = 0  # 0 -> full attention
    # per layer "full_attention" | "sliding_attention"; () -> every layer sliding when sliding_window is set
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float = 0.0  # RoPE base of the sliding layers (Gemma 3); 0 -> rope_theta, same scaling
    # attention variants
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    attn_softcap: float = 0.0  # scores -> c tanh(scores / c) (Gemma 2)
    final_softcap: float = 0.0  # the same on the logits
    query_pre_attn_scalar: float = 0.0  # softmax scale 1/sqrt(this) (Gemma); 0 -> 1/sqrt(head_dim)
    attention_sinks: bool = False  # one learned sink logit per head (gpt-oss)
    o_bias: bool = False
    # layers
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = False
    norm_unit_offset: bool = False  # RMSNorm gain is 1 + w (Gemma)
    sandwich_norm: bool = False  # norms after attention and after the FFN too (Gemma 2/3)
    embed_scale: bool = False  # embeddings times sqrt(dim) (Gemma)
    hidden_act: str = "silu"  # the gated FFN's activation: HIDDEN_ACTS
    swiglu_alpha: float = 1.702  # gpt-oss's clamped SwiGLU: gate * sigmoid(alpha gate) * (up + 1), clamped at limit
    swiglu_limit: float = 7.0
    # the chapter's options (Definitions 18 "Gated Attention" and 21 "Parallel Transformer Block", and the MoE FFN);
    # off for every HF architecture
    gated_attention: bool = False
    parallel_block: bool = False
    n_experts: int = 0
    n_experts_per_token: int = 2
    # mixture of experts (Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss)
    moe_hidden: int = 0  # an expert's hidden width; 0 -> ffn_hidden
    router: str = "softmax"  # ROUTERS: softmax top-k, or DeepSeek-V3's sigmoid scores with grouped top-k
    norm_topk_prob: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    n_shared_experts: int = 0
    first_dense_layers: int = 0  # first_k_dense_replace
    moe_layer_step: int = 1  # decoder_sparse_step: layer i is sparse when (i + 1) % step == 0
    dense_layers: tuple[int, ...] = ()  # mlp_only_layers
    n_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    # multi-head latent attention (DeepSeek-V2/V3): kv_lora_rank > 0 turns it on
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleaved: bool = False  # RoPE pairs (2i, 2i+1) rather than (i, i + D/2) (DeepSeek's rope_interleave)
    # tokens and naming
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    dtype: str = "float32"  # "int8": int8 weight-only linear layers, float32 elsewhere

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be positive and even for RoPE, got {self.head_dim}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")
        if self.n_experts < 0 or (self.n_experts and not 0 < self.n_experts_per_token <= self.n_experts):
            raise ValueError(f"n_experts_per_token must be in [1, n_experts], got {self.n_experts_per_token}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.layer_types and (len(self.layer_types) != self.n_layers or set(self.layer_types) - set(LAYER_TYPES)):
            raise ValueError(f"layer_types must name one of {LAYER_TYPES} for each of the {self.n_layers} layers")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_window must be set when layer_types has sliding_attention layers")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.n_experts and (self.n_expert_groups <= 0 or self.n_experts % self.n_expert_groups
                               or not 0 < self.topk_groups <= self.n_expert_groups):
            raise ValueError(f"n_group ({self.n_expert_groups}) must divide the experts ({self.n_experts}) and "
                             f"topk_group ({self.topk_groups}) be in [1, n_group]")
        if self.kv_lora_rank and (self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2 or self.qk_nope_head_dim < 0
                                  or self.v_head_dim <= 0):
            raise ValueError("qk_rope_head_dim (even), qk_nope_head_dim and v_head_dim must be set for MLA")
        if self.architecture not in (*ARCHITECTURES, GENSERVE_ARCHITECTURE):
            raise ValueError(f"architecture must be one of {(*ARCHITECTURES, GENSERVE_ARCHITECTURE)}")
        if self.dtype not in ("float32", "bfloat16", "float16", "int8"):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or int8, got {self.dtype!r}")

    @property
    def rope_type(self) -> str:
        return str(dict(self.rope_scaling).get("rope_type", dict(self.rope_scaling).get("type", "default")))

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """The rotated width of a head: all of it, or MLA's decoupled RoPE part."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    def layer_window(self, i: int) -> int:
        """The sliding window of layer i, 0 for full attention."""
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else 0

    def layer_is_moe(self, i: int) -> bool:
        """Whether layer i's FFN is the mixture of experts (first_k_dense_replace, mlp_only_layers and
        decoder_sparse_step decide)."""
        return (self.n_experts > 0 and i >= self.first_dense_layers and i not in self.dense_layers
                and (i + 1) % self.moe_layer_step == 0)

    @property
    def kv_cache_layout(self) -> tuple[int, int, bool]:
        """(heads, width, values apart) of one layer's cache entry per token. MLA caches its latent and RoPE key as
        one head of kv_lora_rank + qk_rope_head_dim values, which serves as keys and values both."""
        if self.mla:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, False
        return self.n_kv_heads, self.head_dim, True

    @property
    def uses_seed_options(self) -> bool:
        return self.gated_attention or self.parallel_block or (
            self.n_experts > 0 and self.architecture in ("LlamaForCausalLM", GENSERVE_ARCHITECTURE))

    def replace(self, **changes: Any) -> LlamaConfig:
        return dataclasses.replace(self, **changes)


def _rope_fields(raw: dict) -> tuple[float, dict, float]:
    """RoPE base, scaling and the sliding layers' base from either spelling: 5.x ``rope_parameters`` (flat, or one
    dict per layer type as Gemma 3 writes it) or 4.x ``rope_theta``/``rope_scaling``/``rope_local_base_freq``."""
    params = dict(raw.get("rope_parameters") or {})
    local_theta = float(raw.get("rope_local_base_freq") or 0.0)
    if isinstance(params.get("full_attention"), dict):
        local = params.get("sliding_attention") or {}
        local_theta = float(local.get("rope_theta", local_theta))
        if local.get("rope_type", "default") != "default":
            raise ValueError("rope_parameters.sliding_attention: only the default rope_type is served for sliding "
                             f"layers, got {local.get('rope_type')!r}")
        params = dict(params["full_attention"])
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = dict(raw.get("rope_scaling") or {})
    scaling.update(params)
    if "original_max_position_embeddings" in raw and scaling:
        scaling.setdefault("original_max_position_embeddings", raw["original_max_position_embeddings"])
    if float(scaling.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise ValueError("partial_rotary_factor: only 1.0 (every head dimension rotated) is served")
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = {}
    return float(theta), {k: tuple(v) if isinstance(v, list) else v for k, v in scaling.items()}, local_theta


def _eos_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list | tuple) else (int(eos),)


def _layer_types(raw: dict, arch: str, n_layers: int) -> tuple[str, ...]:
    """Per-layer attention kinds: config.json's ``layer_types``, else the architecture's pattern."""
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    if arch == "Gemma2ForCausalLM":  # even layers slide
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers))
    if arch == "Gemma3ForCausalLM":  # every n-th layer is global
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers))
    return ()


def _family(raw: dict, arch: str, dim: int) -> dict[str, Any]:
    """What an architecture sets beyond the Llama fields."""
    gemma = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
    out: dict[str, Any] = {}
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"):
        out["qk_norm"] = True
    if gemma:
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation: Gemma is served with gelu_pytorch_tanh, got {act!r}")
        out.update(norm_unit_offset=True, sandwich_norm=True, embed_scale=True, hidden_act="gelu_tanh",
                   attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
                   final_softcap=float(raw.get("final_logit_softcapping") or 0.0),
                   query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 0.0))
    elif raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {arch} is served with silu, got {raw.get('hidden_act')!r}")
    if arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM"):
        experts = raw.get("num_experts") or raw.get("num_local_experts")
        if not experts:
            raise ValueError(f"config.json lacks num_experts (or num_local_experts) for {arch}")
        out.update(n_experts=int(experts), n_experts_per_token=int(raw.get("num_experts_per_tok", 2)),
                   moe_hidden=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
                   norm_topk_prob=bool(raw.get("norm_topk_prob", True)))
    if arch == "Qwen3MoeForCausalLM":
        out.update(moe_layer_step=int(raw.get("decoder_sparse_step", 1)),
                   dense_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()))
    if arch == "GptOssForCausalLM":
        out.update(attention_sinks=True, o_bias=True, router_bias=True, expert_bias=True, hidden_act="swiglu_clamped",
                   swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)), swiglu_limit=float(raw.get("swiglu_limit", 7.0)))
    if arch == "DeepseekV3ForCausalLM":
        for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
                    "moe_intermediate_size"):
            if raw.get(key) is None:
                raise ValueError(f"config.json lacks {key} for {arch}")
        if raw.get("topk_method", "noaux_tc") != "noaux_tc" or raw.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError("topk_method/scoring_func: DeepSeek-V3 is served with noaux_tc and sigmoid scores")
        if int(raw.get("moe_layer_freq", 1)) != 1:
            raise ValueError("moe_layer_freq: only 1 (every layer past first_k_dense_replace) is served")
        out.update(q_lora_rank=int(raw.get("q_lora_rank") or 0), kv_lora_rank=int(raw["kv_lora_rank"]),
                   qk_rope_head_dim=int(raw["qk_rope_head_dim"]), qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                   v_head_dim=int(raw["v_head_dim"]), rope_interleaved=bool(raw.get("rope_interleave", True)),
                   n_experts=int(raw["n_routed_experts"]),
                   n_experts_per_token=int(raw.get("num_experts_per_tok", 8)),
                   moe_hidden=int(raw["moe_intermediate_size"]), router="sigmoid_grouped",
                   norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                   n_shared_experts=int(raw.get("n_shared_experts") or 0),
                   first_dense_layers=int(raw.get("first_k_dense_replace", 0)),
                   n_expert_groups=int(raw.get("n_group") or 1), topk_groups=int(raw.get("topk_group") or 1),
                   routed_scaling=float(raw.get("routed_scaling_factor", 1.0)))
    return out


def from_hf(raw: dict) -> LlamaConfig:
    """Build a ``LlamaConfig`` from a Hugging Face (or genserve) ``config.json`` dict."""
    missing = [k for k in REQUIRED_HF_KEYS if k not in raw]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    arch = archs[0]
    if arch not in (*ARCHITECTURES, GENSERVE_ARCHITECTURE):
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    theta, scaling, local_theta = _rope_fields(raw)
    window = raw.get("sliding_window") or 0
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and \
            not raw.get("use_sliding_window", False):
        window = 0
    dim, n_heads, n_layers = int(raw["hidden_size"]), int(raw["num_attention_heads"]), int(raw["num_hidden_layers"])
    layer_types = _layer_types(raw, arch, n_layers) if window else ()
    if layer_types and "sliding_attention" not in layer_types:
        window = 0
    head_dim = raw.get("head_dim") or dim // n_heads
    if arch == "DeepseekV3ForCausalLM":
        head_dim = int(raw.get("qk_nope_head_dim") or 0) + int(raw.get("qk_rope_head_dim") or 0) or head_dim
    fields = dict(
        vocab_size=int(raw["vocab_size"]),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=int(head_dim),
        ffn_hidden=int(raw["intermediate_size"]),
        rope_theta=theta,
        rope_scaling=tuple(sorted(scaling.items())),
        max_position=int(raw.get("max_position_embeddings", 2048)),
        sliding_window=int(window),
        layer_types=layer_types,
        rope_local_theta=local_theta if arch == "Gemma3ForCausalLM" else 0.0,
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
        tie_embeddings=bool(raw.get("tie_word_embeddings", arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"))),
        gated_attention=bool(raw.get("gated_attention", False)),
        parallel_block=bool(raw.get("parallel_block", False)),
        n_experts=int(raw.get("n_experts", 0)),
        n_experts_per_token=int(raw.get("n_experts_per_token", 2)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
        architecture=arch,
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
    )
    return LlamaConfig(**{**fields, **_family(raw, arch, dim)})


def to_hf(config: LlamaConfig) -> dict:
    """The ``config.json`` dict for ``config`` in the transformers 5.x spelling (loadable by ``from_hf``)."""
    arch = GENSERVE_ARCHITECTURE if config.uses_seed_options else config.architecture
    if arch not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", GENSERVE_ARCHITECTURE):
        raise ValueError(f"architecture: config.json is written for Llama, Mistral, Qwen2 and genserve models, "
                         f"not {arch}")
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": MODEL_TYPES.get(arch, "llama"),
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.ffn_hidden,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default", **dict(config.rope_scaling)},
        "attention_bias": config.qkv_bias,
        "tie_word_embeddings": config.tie_embeddings,
        "sliding_window": config.sliding_window or None,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) > 1 else
        (config.eos_token_ids[0] if config.eos_token_ids else None),
        "dtype": config.dtype,
    }
    if config.uses_seed_options:
        out.update(gated_attention=config.gated_attention, parallel_block=config.parallel_block,
                   n_experts=config.n_experts, n_experts_per_token=config.n_experts_per_token)
    return out
