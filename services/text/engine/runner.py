"""The contract between the engine and a model runner (vLLM's worker / model-runner split).

The engine schedules: it decides which tokens of which requests run this step, owns the block tables and checks
every finish condition. A runner computes: it owns the weights, the KV-cache tensors, the forward pass and
sampling, on one kind of device. The engine never learns which device or kernel ran; it hands a runner a
``PagedBatch`` plus the sampled rows' requests and gets token ids (and the logprobs asked for) back. With LoRA
adapters, ``lora`` gives every token's adapter slot (N,) int32 (-1: the base model; None: no adapter in the step),
the slots holding what the engine wrote into ``adapters`` (services/text/adapter_slots.py).

Runners: ``services/text/runners/cpu.py`` (fused C decode step, greedy lookahead) and ``runners/cuda.py`` (torch +
Triton through the backend, sampling on the device, CUDA graphs); ``services/text/runners.make_runner`` picks one
once, at start-up.
"""

from __future__ import annotations

from typing import Protocol

import torch

from genserve.services.text.adapter_slots import AdapterSlots
from genserve.services.text.engine.kv_cache import KVGroup
from genserve.services.text.engine.params import TokenLogprob
from genserve.services.text.engine.sampler import SampleRow
from genserve.services.text.model import LlamaForCausalLM
from genserve.shared.blocks.paged import PagedBatch


class ModelRunner(Protocol):
    name: str  # "cpu" | "cuda": what GetModelInfo reports
    cpu_kernels: bool  # the C kernels are in use (the CPU runner, where they built)
    model: LlamaForCausalLM
    device: torch.device
    kv_dtype: torch.dtype  # what the K/V cache holds; the engine sizes its blocks by it
    adapters: AdapterSlots | None  # the LoRA slots; None when the engine serves no adapters

    def kv_cache_budget(self, kv_cache_bytes: int, kv_cache_fraction: float, min_bytes: int) -> int:
        """Bytes for the KV cache: ``kv_cache_bytes`` when > 0, else ``kv_cache_fraction`` of the device's total
        memory (a fixed budget, whatever else holds the device), else the runner's default; never less than
        ``min_bytes`` (one full context)."""
        ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int, groups: tuple[KVGroup, ...] = ()) -> None:
        """Allocate the per-layer K/V tensors in the paged layout (docs/architecture.md), one block past
        ``num_blocks`` (the null block of kv_cache.py); with ``groups`` (the hybrid allocation), the j-th layers of
        all groups share one tensor (``kv_cache.layer_tensors``)."""
        ...

    def max_steps(self, n_tokens: int) -> int:
        """How many greedy decode steps one ``execute_greedy`` call may take for a decode-only batch of
        ``n_tokens`` tokens; 1 when the runner has no multi-step path."""
        ...

    def draft_rows(self, n_decode: int) -> int:
        """How many speculative draft rows a decode-only step of ``n_decode`` rows may add and stay on the runner's
        fast path (the CPU runner's fused step takes at most 16 rows); drafts past it would move the whole step to
        a slower one."""
        ...

    def execute(self, batch: PagedBatch, rows: list[SampleRow], *, lora: torch.Tensor | None = None
                ) -> list[tuple[int, TokenLogprob | None]]:
        """Run ``batch`` (writing its K/V into the cache) and sample one token per row of ``batch.logits_index``;
        ``rows[i]`` is the request behind logits row i."""
        ...

    def execute_logits(self, batch: PagedBatch, *, lora: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``batch`` (writing its K/V into the cache) through the model's plain forward pass and return the
        next-token logits (S, V) of ``batch.logits_index``, on the runner's device (the speculative verify pass)."""
        ...

    def execute_greedy(self, batch: PagedBatch, steps: int, *, lora: torch.Tensor | None = None) -> list[list[int]]:
        """``steps`` greedy tokens for every token of a decode-only batch whose block tables already cover them."""
        ...
