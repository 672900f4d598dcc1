"""The Llama-family model config, and its translation from/to Hugging Face ``config.json`` files.

One frozen dataclass describes every decoder the text service runs: Llama, Mistral (sliding window), Qwen2
(q/k/v biases, tied embeddings) and our own models with the options of the chapter "Deep Learning Building Blocks"
(gated attention, Definition 18 "Gated Attention"; parallel block, Definition 21 "Parallel Transformer Block";
mixture-of-experts FFN). ``from_hf`` accepts both the transformers 4.x spelling (top-level ``rope_theta``/
``rope_scaling``, ``torch_dtype``) and the 5.x one (``rope_parameters``, ``dtype``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# The chapter's options (module docstring) have no HF equivalent; checkpoints using them carry this architecture name.
GENSERVE_ARCHITECTURE = "GenserveForCausalLM"
REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


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
    # layers
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = False
    # the chapter's options (Definitions 18 "Gated Attention" and 21 "Parallel Transformer Block", and the MoE FFN);
    # off for every HF architecture
    gated_attention: bool = False
    parallel_block: bool = False
    n_experts: int = 0
    n_experts_per_token: int = 2
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
        if self.architecture not in (*ARCHITECTURES, GENSERVE_ARCHITECTURE):
            raise ValueError(f"architecture must be one of {(*ARCHITECTURES, GENSERVE_ARCHITECTURE)}")
        if self.dtype not in ("float32", "bfloat16", "float16", "int8"):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or int8, got {self.dtype!r}")

    @property
    def rope_type(self) -> str:
        return str(dict(self.rope_scaling).get("rope_type", dict(self.rope_scaling).get("type", "default")))

    @property
    def uses_seed_options(self) -> bool:
        return self.gated_attention or self.parallel_block or self.n_experts > 0

    def replace(self, **changes: Any) -> LlamaConfig:
        return dataclasses.replace(self, **changes)


def _rope_fields(raw: dict) -> tuple[float, dict]:
    """RoPE base and scaling from either spelling: 5.x ``rope_parameters`` or 4.x ``rope_theta``/``rope_scaling``."""
    params = dict(raw.get("rope_parameters") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = dict(raw.get("rope_scaling") or {})
    scaling.update(params)
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = {}
    return float(theta), scaling


def _eos_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list | tuple) else (int(eos),)


def from_hf(raw: dict) -> LlamaConfig:
    """Build a ``LlamaConfig`` from a Hugging Face (or genserve) ``config.json`` dict."""
    missing = [k for k in REQUIRED_HF_KEYS if k not in raw]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    arch = archs[0]
    if arch not in (*ARCHITECTURES, GENSERVE_ARCHITECTURE):
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    theta, scaling = _rope_fields(raw)
    window = raw.get("sliding_window") or 0
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        window = 0
    dim, n_heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    return LlamaConfig(
        vocab_size=int(raw["vocab_size"]),
        dim=dim,
        n_layers=int(raw["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=int(raw.get("head_dim") or dim // n_heads),
        ffn_hidden=int(raw["intermediate_size"]),
        rope_theta=theta,
        rope_scaling=tuple(sorted(scaling.items())),
        max_position=int(raw.get("max_position_embeddings", 2048)),
        sliding_window=int(window),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        gated_attention=bool(raw.get("gated_attention", False)),
        parallel_block=bool(raw.get("parallel_block", False)),
        n_experts=int(raw.get("n_experts", 0)),
        n_experts_per_token=int(raw.get("n_experts_per_token", 2)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
        architecture=arch,
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
    )


def to_hf(config: LlamaConfig) -> dict:
    """The ``config.json`` dict for ``config`` in the transformers 5.x spelling (loadable by ``from_hf``)."""
    arch = GENSERVE_ARCHITECTURE if config.uses_seed_options else config.architecture
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": {"MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}.get(arch, "llama"),
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
