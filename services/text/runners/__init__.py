"""Model runners, one per device kind (services/text/engine/runner.py has the contract); ``make_runner`` picks one
once, at start-up, from the model's device and backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

from genserve.services.text.engine.runner import ModelRunner
from genserve.services.text.model import LlamaForCausalLM

if TYPE_CHECKING:
    from genserve.services.text.engine.adapters import LoraConfig


def make_runner(model: LlamaForCausalLM, *, max_lookahead: int = 8, max_running: int = 64,
                cuda_graphs: bool = True, lora: LoraConfig | None = None) -> ModelRunner:
    """The CUDA runner for a model on a GPU, or wherever the backend is forced to Triton (GENSERVE_BACKEND=triton;
    on CPU tensors that means the Triton interpreter); the CPU runner otherwise, whose fused C step serves the torch
    backends ("auto", "torch") and stays off for the written-out "reference" math. ``lora``: the runner holds
    ``lora.max_loras`` adapter slots of rank ``lora.max_lora_rank`` (adapter_slots.py)."""
    slots = (0, 0) if lora is None else (lora.max_loras, lora.max_lora_rank)
    device = model.model.embed_tokens.weight.device
    if device.type == "cuda" or model.backend.name == "triton":
        from genserve.services.text.runners.cuda import CudaRunner

        return CudaRunner(model, max_running=max_running, cuda_graphs=cuda_graphs, lora_slots=slots)
    from genserve.services.text.runners.cpu import CpuRunner

    return CpuRunner(model, max_lookahead=max_lookahead, fused=model.backend.name in ("auto", "torch"),
                     lora_slots=slots)
