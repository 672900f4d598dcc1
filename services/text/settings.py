"""The text app's settings, from its serve config `args` (deploy/serve_config*.yaml), validated with pydantic: a bad
value fails the deploy with the field named. They flow one way: `args` -> `TextArgs` -> `EngineConfig` + the load
dtype -> the runner; GetModelInfo reports what took effect (docs/deploy.md lists every field)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from genserve.services.common.builder import AppArgs
from genserve.services.text.engine.adapters import LoraConfig
from genserve.services.text.engine.engine import EngineConfig
from genserve.services.text.engine.progress import DEFAULT_STALL_S
from genserve.services.text.engine.speculative import SpeculativeConfig
from genserve.services.text.schema import ADAPTER_NAME, ADAPTER_NAME_RULE, IMAGE_MODEL_ID, TEXT_MODEL_ID

MAX_MODELS = 16


class SpeculativeArgs(BaseModel):
    """`speculative:` in the serve config: exact speculative decoding (services/text/engine/speculative.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # ngram: prompt lookup (Saxena 2023), drafts from the prompt and output so far; draft: a smaller model's drafts
    method: Literal["ngram", "draft"] = "ngram"
    num_tokens: int = Field(SpeculativeConfig.num_tokens, ge=1, le=16)  # drafted tokens per step
    ngram_min: int = Field(SpeculativeConfig.ngram_min, ge=1, le=64)
    ngram_max: int = Field(SpeculativeConfig.ngram_max, ge=1, le=64)
    # speculation switches off in a step where more sequences than this decode
    max_batch: int = Field(SpeculativeConfig.max_batch, ge=1, le=4096)
    # method draft: the draft model, a HF folder or GGUF file with the target's tokenizer, loaded like the target
    draft_model_dir: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeArgs:
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min: must be <= ngram_max")
        if self.method == "draft" and self.draft_model_dir is None:
            raise ValueError("draft_model_dir: method draft needs the draft model's folder or GGUF file")
        if self.method != "draft" and self.draft_model_dir is not None:
            raise ValueError("draft_model_dir: given only with method draft")
        return self

    def config(self) -> SpeculativeConfig:
        return SpeculativeConfig(method=self.method, num_tokens=self.num_tokens, ngram_min=self.ngram_min,
                                 ngram_max=self.ngram_max, max_batch=self.max_batch,
                                 draft_model_dir=self.draft_model_dir or "")


class LoraArgs(BaseModel):
    """`lora:` in the serve config: PEFT adapters over the base model (services/text/engine/adapters.py), loaded at
    start from `adapters` and at run time by the admin calls (LoadAdapter, POST /v1/load_lora_adapter)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Adapters load only from folders under this one (symlinks resolved); a path outside it is refused.
    root: str = Field(min_length=1)
    max_loras: int = Field(LoraConfig.max_loras, ge=1, le=64)  # distinct adapters in one batch (the runner's slots)
    max_cpu_loras: int = Field(LoraConfig.max_cpu_loras, ge=1, le=1024)  # adapters kept in memory, LRU past that
    max_lora_rank: int = Field(LoraConfig.max_lora_rank, ge=1, le=512)
    # name -> folder (relative to root, or absolute under it), loaded on every replica at start
    adapters: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _fits(self) -> LoraArgs:
        if self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras: must be >= max_loras (a batch's adapters are all in memory)")
        for name in self.adapters:
            if not ADAPTER_NAME.fullmatch(name):
                raise ValueError(f"adapters: {name!r} is not an adapter name ({ADAPTER_NAME_RULE})")
        return self

    def folders(self) -> dict[str, str]:
        """The start-up adapters' folders resolved as the engine's registry resolves them (the root's symlinks too)."""
        root = Path(self.root).resolve()
        return {name: str((root / path).resolve()) for name, path in self.adapters.items()}

    def config(self) -> LoraConfig:
        return LoraConfig(root=self.root, max_loras=self.max_loras, max_cpu_loras=self.max_cpu_loras,
                          max_lora_rank=self.max_lora_rank, adapters=tuple(self.adapters.items()))


class TextArgs(AppArgs):
    # "auto": bfloat16 on CUDA, float32 on the CPU; "int8": int8 weight-only linear layers.
    dtype: Literal["auto", "float32", "bfloat16", "float16", "int8"] = "auto"
    # The KV cache: bytes, or a fraction of the device's memory (CUDA: of the GPU's total, a fixed budget whatever
    # other replicas took first); neither: the runner's default. Never below one full context.
    kv_cache_bytes: int | None = Field(None, gt=0)
    kv_cache_fraction: float | None = Field(None, gt=0, lt=1)
    # The defaults are EngineConfig's, set there once.
    max_batched_tokens: int = Field(EngineConfig.max_batched_tokens, ge=1, le=1 << 20)  # tokens per engine step
    max_running: int = Field(EngineConfig.max_running, ge=1, le=4096)  # sequences in the running batch
    # greedy steps per call where the runner has a multi-step path
    max_lookahead: int = Field(EngineConfig.max_lookahead, ge=1, le=64)
    cuda_graphs: bool = EngineConfig.cuda_graphs  # decode steps replayed from CUDA graphs (CUDA runner)
    prefix_caching: bool = EngineConfig.prefix_caching  # full KV blocks reused across requests that share a prefix
    # Work waits and no engine step finished for this long: health says NOT_SERVING and Ray replaces the replica.
    stall_seconds: float = Field(DEFAULT_STALL_S, gt=0, le=3600)
    # Exact speculative decoding (engine/speculative.py); absent: off.
    speculative: SpeculativeArgs | None = None
    # Tokens of a grammar's forced text drafted per step (jump-forward, engine/speculative.py); 0: off.
    max_jump_forward: int = Field(EngineConfig.max_jump_forward, ge=0, le=64)
    # LoRA adapters (docs/deploy.md); absent: none may be loaded, and the model runs without the LoRA hooks.
    lora: LoraArgs | None = None
    # Further base models served by each replica beside `model_dir`, by name (TextRequest.model, the OpenAI API's
    # `model`): a HF folder or GGUF file each. Each has its own engine and KV cache with the settings above, but no
    # LoRA adapters and no draft model (n-gram speculation applies). Every engine steps on its own thread, so they
    # share the replica's cores: for the speed of one busy model, give it an app of its own (docs/deploy.md).
    models: dict[str, str] = Field(default_factory=dict, max_length=MAX_MODELS)

    @model_validator(mode="after")
    def _one_kv_budget(self) -> TextArgs:
        if self.kv_cache_bytes is not None and self.kv_cache_fraction is not None:
            raise ValueError("kv_cache_bytes: give kv_cache_bytes or kv_cache_fraction, not both")
        return self

    @model_validator(mode="after")
    def _model_names(self) -> TextArgs:
        adapters = set(self.lora.adapters) if self.lora is not None else set()
        for name, path in self.models.items():
            if not ADAPTER_NAME.fullmatch(name) or name in (TEXT_MODEL_ID, IMAGE_MODEL_ID):
                raise ValueError(f"models: {name!r} is not a model name ({ADAPTER_NAME_RULE}; not {TEXT_MODEL_ID} "
                                 f"or {IMAGE_MODEL_ID}, the OpenAI API's ids of the first text and the image model)")
            if name in adapters:
                raise ValueError(f"models: {name!r} is also the name of a LoRA adapter in lora.adapters")
            if not Path(path).exists():
                raise ValueError(f"models.{name}: {path!r} is no folder or file")
        return self

    def engine_config(self, *, first: bool = True) -> EngineConfig:
        """The engine's settings; `first` False: for one of the further `models` (no adapters, no draft model)."""
        spec = self.speculative
        if spec is not None and not first and spec.method == "draft":
            spec = None
        return EngineConfig(
            kv_cache_bytes=self.kv_cache_bytes or 0, kv_cache_fraction=self.kv_cache_fraction or 0.0,
            max_batched_tokens=self.max_batched_tokens, max_running=self.max_running,
            max_lookahead=self.max_lookahead, cuda_graphs=self.cuda_graphs, prefix_caching=self.prefix_caching,
            speculative=spec.config() if spec is not None else None,
            max_jump_forward=self.max_jump_forward,
            lora=self.lora.config() if self.lora is not None and first else None,
        )
