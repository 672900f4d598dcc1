"""The CPU model runner: prefill and mixed steps through ``LlamaForCausalLM.forward_paged`` (torch ops and the
per-op C kernels behind the backend), decode-only steps through one fused C call per step
(``genserve.kernels.cpu_decode_step``), and greedy lookahead: several decode steps per call, the argmax fed back in C.
The projections and the LM head may be fp32 or bf16, keep a GGUF checkpoint's Q8_0/Q4_0/Q4_1 blocks (``QuantLinear``) or
be int8 rows (``Int8Linear``): the fused step widens them inside its products.

A decode step reads every weight once; op by op in PyTorch, the small tensor ops around the matrix-vector products
cost about as much again as the products themselves, hence the fused step. It applies to fp32, bf16 and int8
Llama-family models with SwiGLU FFNs and rotate-half RoPE, QK-norm (Qwen3) and longrope tables (Phi-3) included;
anything else (fp16, gated attention, the parallel block, MoE, MLA, soft-capping, sinks, Gemma's norms, interleaved
RoPE, a biased LM head, or no C compiler) keeps ``forward_paged``. For fp32 models it computes what
``forward_paged`` does; for bf16 and int8 ones it keeps fp32 activations where the torch path rounds them to bf16
(closer to the fp32 model, not bit-equal to the torch path). The runner first moves the weights into huge pages
(runners/huge_pages.py).

LoRA adapters keep the fused step: it reads the adapter slots (adapter_slots.py, fp32 whatever the model's dtype)
and adds each row's delta inside the step, right after the product it adapts (csrc/decode_step.c).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from genserve.kernels import _cpu_library, cpu_decode_step
from genserve.services.text.adapter_slots import AdapterSlots
from genserve.services.text.engine.kv_cache import KVGroup, layer_tensors
from genserve.services.text.engine.params import TokenLogprob
from genserve.services.text.engine.sampler import SampleRow, sample_batch
from genserve.services.text.model import LlamaForCausalLM
from genserve.services.text.quantize import Int8Linear
from genserve.services.text.runners.huge_pages import move_to_huge_pages
from genserve.shared.blocks.ffn import SwiGLU
from genserve.shared.blocks.paged import PagedBatch
from genserve.shared.blocks.quant_linear import QuantLinear

# The fused kernel's products run row by row: past this many tokens, blocked GEMMs (forward_paged) win.
FUSED_MAX_TOKENS = 16
DEFAULT_KV_CACHE_BYTES = 256 * 2**20


def _weight(linear: nn.Module) -> cpu_decode_step.Matrix | None:
    """The matrix of a linear layer as the fused kernel takes it; None for a layer it does not read."""
    if isinstance(linear, QuantLinear):
        return cpu_decode_step.QuantWeight(linear.blocks, linear.qtype)
    if isinstance(linear, Int8Linear):
        return cpu_decode_step.Int8Rows(linear.weight, linear.scales)
    return linear.weight.detach() if isinstance(linear, nn.Linear) else None


def _fused_matrix(linear: nn.Module) -> bool:
    """A product the fused kernel reads (cpu_decode_step.fused_matrix_ok)."""
    w = _weight(linear)
    return w is not None and cpu_decode_step.fused_matrix_ok(w)


def _fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    """A norm gain or a bias in fp32, as the kernel reads them (the tensor itself for an fp32 model)."""
    return None if t is None else t.detach().float()


class FusedDecodeStep:
    """The whole decode step of ``model`` in one kernel call: the runner packs the model's weights into the kernel's
    per-layer structs once (pointers into the model's own tensors, no copies)."""

    def __init__(self, model: LlamaForCausalLM, adapters: AdapterSlots | None = None):
        self.model = model
        cfg = model.config
        layers = []
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(cpu_decode_step.LayerWeights(
                ln1=_fp32(layer.input_layernorm.weight), ln2=_fp32(layer.post_attention_layernorm.weight),
                wq=_weight(attn.q_proj), wk=_weight(attn.k_proj), wv=_weight(attn.v_proj), wo=_weight(attn.o_proj),
                bq=_fp32(attn.q_proj.bias), bk=_fp32(attn.k_proj.bias), bv=_fp32(attn.v_proj.bias),
                wg=_weight(mlp.gate_proj), wu=_weight(mlp.up_proj), wd=_weight(mlp.down_proj),
                n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, eps=cfg.norm_eps,
                scale=attn.sm_scale, window=layer.window,
                q_norm=None if attn.q_norm is None else _fp32(attn.q_norm.weight),
                k_norm=None if attn.k_norm is None else _fp32(attn.k_norm.weight),
                lora=None if adapters is None else {name: adapters.stacks[(i, name)] for name in cpu_decode_step.LORA
                                                    if (i, name) in adapters.stacks}))
        self.kernel = cpu_decode_step.StepKernel(
            layers, embed=model.model.embed_tokens.weight.detach(), norm=_fp32(model.model.norm.weight),
            eps=model.model.norm.eps, head=_weight(model.lm_head), n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim, ffn=cfg.ffn_hidden, lora_rank=0 if adapters is None else adapters.max_rank)
        self.cos, self.sin = (t.float().contiguous() for t in model.rope.tables())  # bf16 in a bf16 model

    @staticmethod
    def applies(model: nn.Module) -> bool:
        """True when the fused kernel runs this model's decode step (checked before the kernels are built, so a model
        it cannot run never compiles them)."""
        if not isinstance(model, LlamaForCausalLM):
            return False
        cfg, head = model.config, model.lm_head
        if cfg.gated_attention or cfg.parallel_block or cfg.n_experts or not _llama_shaped(cfg):
            return False
        if not _fused_matrix(head) or head.bias is not None or \
                model.model.embed_tokens.weight.dtype not in (torch.float32, torch.bfloat16):
            return False
        for layer in model.model.layers:
            attn = layer.self_attn
            projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp.gate_proj,
                           layer.mlp.up_proj, layer.mlp.down_proj) if isinstance(layer.mlp, SwiGLU) else ()
            if (attn.rope_interleaved or attn.o_proj.bias is not None or not projections
                    or layer.mlp.activation != "silu"
                    or not all(map(_fused_matrix, projections))):
                return False
        return True

    def __call__(self, batch: PagedBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 lora: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits (S, V) for a batch of decode tokens only (``batch.prefills`` empty); ``lora``: each
        token's adapter slot, or None."""
        if batch.prefills:
            raise ValueError("the fused decode step runs decode-only batches; prefill chunks go through forward_paged")
        slots, tables, groups = _group_inputs(batch)
        logits = self.kernel.run(batch.input_ids, batch.positions, slots, tables, batch.decode_lens, self.cos,
                                 self.sin, k_caches, v_caches, lora, groups)  # (M, V): every decode token samples
        return logits if logits.shape[0] == batch.logits_index.numel() else logits[batch.logits_index]

    def greedy(self, batch: PagedBatch, steps: int, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
               lora: torch.Tensor | None = None) -> list[list[int]]:
        """``steps`` greedy tokens for every decode token of a decode-only batch, in one kernel call: each row's
        argmax is fed back at its next position. The batch's block tables must already cover ``steps`` positions
        from each token's."""
        if batch.prefills:
            raise ValueError("the fused decode step runs decode-only batches; prefill chunks go through forward_paged")
        slots, tables, groups = _group_inputs(batch)
        return self.kernel.greedy(steps, batch.input_ids, batch.positions, slots, tables, batch.decode_lens, self.cos,
                                  self.sin, k_caches, v_caches, lora, groups).tolist()


def _group_inputs(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The batch's slots and decode tables as the fused step takes them: group 0's, or with a hybrid KV cache every
    group's stacked, (G, M) and (G, M, max_blocks), with each layer's group (L,) int64."""
    if not batch.groups:
        return batch.slots, batch.decode_tables, None
    return (torch.stack([batch.slots, *(g.slots for g in batch.groups)]),
            torch.stack([batch.decode_tables, *(g.decode_tables for g in batch.groups)]),
            torch.tensor(batch.layer_groups, dtype=torch.int64))


def _llama_shaped(cfg) -> bool:
    """The layer the fused kernel computes: one RMSNorm before each sublayer, plain softmax attention with one RoPE
    table and rotate-half pairs, SwiGLU; per-layer windows, any softmax scale and QK-norm (Qwen3) are fine."""
    return not (cfg.mla or cfg.attn_softcap or cfg.final_softcap or cfg.attention_sinks
                or cfg.norm_unit_offset or cfg.sandwich_norm or cfg.embed_scale or cfg.rope_local_theta
                or cfg.hidden_act != "silu" or cfg.rope_interleaved)


def _memory_available() -> int:
    """MemAvailable from /proc/meminfo (bytes), the memory a new allocation can take without swapping."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class CpuRunner:
    name = "cpu"

    def __init__(self, model: LlamaForCausalLM, *, max_lookahead: int = 8, fused: bool = True,
                 lora_slots: tuple[int, int] = (0, 0)):
        """``lora_slots``: (adapter slots, their largest rank); (0, 0) for none."""
        self.model = model.eval()
        self.device = torch.device("cpu")
        # The cache holds what the embedding holds: fp32, or bf16 (rounded to nearest-even on write) for bf16 models.
        self.kv_dtype = model.model.embed_tokens.weight.dtype
        self.max_lookahead = max_lookahead
        self.arena = move_to_huge_pages(self.model)  # first: the fused step below keeps pointers into the weights
        self.adapters = AdapterSlots(model, *lora_slots, torch.float32) if lora_slots[0] else None
        # The fused C step where it applies and the kernels built; the model's per-layer forward otherwise.
        self.fused = FusedDecodeStep(model, self.adapters) if fused and FusedDecodeStep.applies(model) and \
            cpu_decode_step.available() else None
        self.cpu_kernels = _cpu_library.status().available  # per-op kernels behind the backend, or the fused step
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []

    def kv_cache_budget(self, kv_cache_bytes: int, kv_cache_fraction: float, min_bytes: int) -> int:
        if kv_cache_bytes:
            return kv_cache_bytes
        if kv_cache_fraction:
            return int(kv_cache_fraction * _memory_available())
        return max(DEFAULT_KV_CACHE_BYTES, min_bytes)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, groups: tuple[KVGroup, ...] = ()) -> None:
        cfg = self.model.config
        heads, width, values_apart = cfg.kv_cache_layout
        # One block past the engine's: the null block that sliding groups' released table entries name.
        shape = (num_blocks + 1, block_size, heads, width)
        tensor_of = layer_tensors(cfg.n_layers, groups)
        keys = [torch.zeros(shape, dtype=self.kv_dtype) for _ in range(max(tensor_of) + 1)]
        # MLA's one cache is its keys and its values (mla.py)
        values = [torch.zeros(shape, dtype=self.kv_dtype) if values_apart else k for k in keys]
        self.k_caches = [keys[j] for j in tensor_of]
        self.v_caches = [values[j] for j in tensor_of]

    def max_steps(self, n_tokens: int) -> int:
        return self.max_lookahead if self.fused is not None and n_tokens <= FUSED_MAX_TOKENS else 1

    def draft_rows(self, n_decode: int) -> int:
        if self.fused is None or n_decode > FUSED_MAX_TOKENS:
            return 1 << 30  # the step runs forward_paged whatever the drafts
        return FUSED_MAX_TOKENS - n_decode

    def execute(self, batch: PagedBatch, rows: list[SampleRow], *, lora: torch.Tensor | None = None
                ) -> list[tuple[int, TokenLogprob | None]]:
        return sample_batch(self.execute_logits(batch, lora=lora), rows)

    def execute_logits(self, batch: PagedBatch, *, lora: torch.Tensor | None = None) -> torch.Tensor:
        # Also a speculative verify step: k + 1 decode rows per drafted sequence (engine/batch.py), on the fused step
        # where it applies. Its tables are the per-position ones: a prompt token rotated with longrope's long
        # factors (a one-token chunk of a long prompt) goes through forward_paged.
        if self.fused is not None and not batch.prefills and batch.long_rope is None and \
                batch.n_decode <= FUSED_MAX_TOKENS:
            return self.fused(batch, self.k_caches, self.v_caches, lora)  # (S, V)
        if lora is None:
            return self.model.forward_paged(batch, self.k_caches, self.v_caches)
        with self.adapters.applied(lora):
            return self.model.forward_paged(batch, self.k_caches, self.v_caches)

    def execute_greedy(self, batch: PagedBatch, steps: int, *, lora: torch.Tensor | None = None) -> list[list[int]]:
        if self.fused is None:
            raise RuntimeError("this model has no fused decode step: max_steps() is 1")
        return self.fused.greedy(batch, steps, self.k_caches, self.v_caches, lora)
