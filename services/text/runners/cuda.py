"""The CUDA model runner: every step through ``LlamaForCausalLM.forward_paged`` on the backend's Triton kernels
(flash attention for prefill, paged decode, fused RMSNorm with the residual add, RoPE), sampling on the device, and
decode-only steps replayed from CUDA graphs.

Per step, only the sampled ids (and the logprobs a request asked for) are copied to the host. The same runner runs
on CPU tensors when ``GENSERVE_BACKEND=triton`` forces the Triton kernels there (under ``TRITON_INTERPRET=1``), which
tests this runner's math without a GPU; graphs are then off and the decode batch runs eagerly on the same padded
buffers.

CUDA graphs: a decode step launches a few kernels per layer for a handful of tokens, so at small batch sizes the
launches, not the GPU, set the pace. One graph is captured per padded batch size (``GRAPH_BATCH_SIZES`` up to
``max_running``); a decode batch copies its tokens into the static buffers of the next size up, and the rows past
its own attend to one private sink slot of the cache, so they neither read nor write anyone's keys. A decode step
with LoRA adapter rows runs eagerly (the Triton LoRA kernels, kernels/lora.py), outside the graphs.
"""

from __future__ import annotations

import logging

import torch

from genserve.services.text.adapter_slots import AdapterSlots
from genserve.services.text.engine.kv_cache import KVGroup, layer_groups, layer_tensors
from genserve.services.text.engine.params import TokenLogprob
from genserve.services.text.engine.sampler import SampleRow, sample_batch
from genserve.services.text.model import LlamaForCausalLM
from genserve.shared.blocks.paged import GroupTables, PagedBatch

log = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DEFAULT_KV_CACHE_FRACTION = 0.5  # of the device's total memory (replicas may share a GPU: set it per app)
KV_HEADROOM_BYTES = 2**30  # left free beside the cache: activations of a max_batched_tokens step, graph pools
CPU_DEFAULT_KV_CACHE_BYTES = 256 * 2**20


class DecodeGraphs:
    """Static decode batches, one per padded size, and (on CUDA) the graph of ``forward_paged`` over each."""

    def __init__(self, model: LlamaForCausalLM, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], *,
                 max_batch: int, max_blocks: int, sink_block: int, capture: bool, layer_groups: tuple[int, ...] = ()):
        """``layer_groups``: each layer's KV group of a hybrid cache (PagedBatch.layer_groups); the static slots and
        tables then hold one row set per group."""
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        larger = [s for s in GRAPH_BATCH_SIZES if s >= max_batch]
        self.sizes = [s for s in GRAPH_BATCH_SIZES if s < max_batch] + [larger[0] if larger else max_batch]
        n, device = self.sizes[-1], k_caches[0].device
        self.block_size = k_caches[0].shape[1]
        self.sink_block = sink_block
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.layer_groups = layer_groups
        n_groups = max(layer_groups, default=0) + 1
        self.slots = torch.full((n_groups, n), sink_block * self.block_size, dtype=torch.long, device=device)
        self.tables = torch.full((n_groups, n, max_blocks), sink_block, dtype=torch.int32, device=device)
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        self.index = torch.arange(n, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _static_batch(self, size: int, width: int | None = None) -> PagedBatch:
        """The first ``size`` static rows; ``width`` block-table columns (all of them, as graphs capture them)."""
        return PagedBatch(input_ids=self.ids[:size], positions=self.positions[:size], slots=self.slots[0, :size],
                          decode_tables=self.tables[0, :size, :width], decode_lens=self.lens[:size], prefills=(),
                          logits_index=self.index[:size], layer_groups=self.layer_groups,
                          groups=tuple(GroupTables(self.slots[g, :size], self.tables[g, :size, :width], ())
                                       for g in range(1, self.slots.shape[0])))

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for size in reversed(self.sizes):  # the largest first, so the smaller ones reuse its pool
                batch = self._static_batch(size)
                for _ in range(2):  # autotuning and first allocations happen outside the capture
                    self.model.forward_paged(batch, self.k_caches, self.v_caches)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self.model.forward_paged(batch, self.k_caches, self.v_caches)
                self.graphs[size] = (graph, logits)
        torch.cuda.current_stream().wait_stream(stream)

    def run(self, batch: PagedBatch) -> torch.Tensor:
        """Logits (n, V) of a decode-only batch of n <= max_batch tokens, through the static buffers."""
        n = batch.n_decode
        size = next(s for s in self.sizes if s >= n)
        width = batch.decode_tables.shape[1]
        self.ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        for g in range(self.slots.shape[0]):
            view = batch.group(g)
            self.slots[g, :n].copy_(view.slots, non_blocking=True)
            self.tables[g, :n, :width].copy_(view.decode_tables, non_blocking=True)
        self.tables[:, :n, width:] = 0
        self.lens[:n].copy_(batch.decode_lens, non_blocking=True)
        # Rows n..size-1 keep what the previous, larger step left there: restore them to the sink.
        self.ids[n:size] = 0
        self.positions[n:size] = 0
        self.slots[:, n:size] = self.sink_block * self.block_size
        self.tables[:, n:size] = self.sink_block
        self.lens[n:size] = 1
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
            return logits[:n]
        # Eager: only the batch's own table width, which a backend that gathers whole tables (torch) reads per layer.
        return self.model.forward_paged(self._static_batch(size, width), self.k_caches, self.v_caches)[:n]


class CudaRunner:
    name = "cuda"
    cpu_kernels = False  # never built here: a CUDA replica must not compile CPU kernels at start-up

    def __init__(self, model: LlamaForCausalLM, *, max_running: int = 64, cuda_graphs: bool = True,
                 lora_slots: tuple[int, int] = (0, 0)):
        """``lora_slots``: (adapter slots, their largest rank); (0, 0) for none."""
        self.model = model.eval()
        self.device = model.model.embed_tokens.weight.device
        self.kv_dtype = model.model.embed_tokens.weight.dtype  # the model's compute dtype (bf16 on GPUs)
        self.max_running = max_running
        # Graphs only over the Triton kernels: their decode tables are as wide as the model's context, which the paged
        # kernel never reads past a sequence's length, while torch's paged decode (GENSERVE_BACKEND=torch) would
        # gather every column in every layer (128k tokens x 64 rows x 8 heads x 128 x 2 bytes: 16 GB a layer).
        self.cuda_graphs = (cuda_graphs and self.device.type == "cuda" and not model.config.n_experts
                            and model.backend.name in ("auto", "triton"))
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.graphs: DecodeGraphs | None = None
        self.adapters = AdapterSlots(model, *lora_slots, self.kv_dtype) if lora_slots[0] else None

    def kv_cache_budget(self, kv_cache_bytes: int, kv_cache_fraction: float, min_bytes: int) -> int:
        """A fixed budget: ``kv_cache_fraction`` of the GPU's total memory, not of what is free when this replica
        starts, so replicas sharing a GPU get the same cache whatever order they start in; at least ``min_bytes``.
        A budget that does not fit in the free memory (less ``KV_HEADROOM_BYTES`` for activations and graphs) is
        refused here, by name, rather than failing later in an out-of-memory error."""
        if kv_cache_bytes:
            return kv_cache_bytes
        if self.device.type != "cuda":
            return max(CPU_DEFAULT_KV_CACHE_BYTES, min_bytes)
        free, total = torch.cuda.mem_get_info(self.device)
        fraction = kv_cache_fraction or DEFAULT_KV_CACHE_FRACTION
        budget = max(int(fraction * total), min_bytes)
        if budget > free - KV_HEADROOM_BYTES:
            raise RuntimeError(
                f"the KV cache needs {budget / 2**30:.2f} GiB (kv_cache_fraction {fraction} of {total / 2**30:.1f} "
                f"GiB, at least one full context: {min_bytes / 2**30:.2f} GiB) plus {KV_HEADROOM_BYTES / 2**30:.0f} "
                f"GiB of headroom, but {free / 2**30:.2f} GiB are free on {self.device}: lower kv_cache_fraction "
                "or the max_context, or the other replicas' share of this GPU")
        return budget

    def allocate_kv_cache(self, num_blocks: int, block_size: int, groups: tuple[KVGroup, ...] = ()) -> None:
        cfg = self.model.config
        # One block past the engine's: the sink that padded graph rows read and write, which is also the null block
        # that sliding groups' released table entries name (read only under a window's mask).
        heads, width, values_apart = cfg.kv_cache_layout
        shape = (num_blocks + 1, block_size, heads, width)
        tensor_of = layer_tensors(cfg.n_layers, groups)
        keys = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(max(tensor_of) + 1)]
        # MLA's one cache is its keys and its values (mla.py)
        values = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) if values_apart else k for k in keys]
        self.k_caches = [keys[j] for j in tensor_of]
        self.v_caches = [values[j] for j in tensor_of]
        max_blocks = -(-cfg.max_position // block_size)
        kwargs = dict(max_batch=self.max_running, max_blocks=max_blocks, sink_block=num_blocks,
                      layer_groups=layer_groups(groups))
        try:
            self.graphs = DecodeGraphs(self.model, self.k_caches, self.v_caches, capture=self.cuda_graphs, **kwargs)
        except RuntimeError as exc:  # a kernel that cannot be captured: keep the eager path, say so once
            log.warning("CUDA graphs off, decode steps run eagerly: %s", exc)
            self.cuda_graphs = False
            self.graphs = DecodeGraphs(self.model, self.k_caches, self.v_caches, capture=False, **kwargs)

    def max_steps(self, n_tokens: int) -> int:
        return 1

    def draft_rows(self, n_decode: int) -> int:
        # A step with drafts runs forward_paged eagerly, not from a CUDA graph, however many rows it adds.
        return 1 << 30

    def execute(self, batch: PagedBatch, rows: list[SampleRow], *, lora: torch.Tensor | None = None
                ) -> list[tuple[int, TokenLogprob | None]]:
        if lora is None and not batch.prefills and batch.long_rope is None and self.graphs is not None and \
                batch.n_decode <= self.graphs.max_batch:
            batch = batch.to(self.device)  # the step's one host-to-device copy (PagedBatch.to)
            logits = self.graphs.run(batch)
            if batch.logits_index.numel() != batch.n_decode:
                # A one-token prefill chunk that does not sample sits among the decode rows: keep the sampled rows.
                logits = logits[batch.logits_index]
        else:
            logits = self.execute_logits(batch, lora=lora)
        return sample_batch(logits, rows)

    def execute_logits(self, batch: PagedBatch, *, lora: torch.Tensor | None = None) -> torch.Tensor:
        # A speculative verify step (k + 1 decode rows per drafted sequence, engine/batch.py) through forward_paged.
        if lora is None:
            return self.model.forward_paged(batch, self.k_caches, self.v_caches)
        with self.adapters.applied(lora):
            return self.model.forward_paged(batch, self.k_caches, self.v_caches)

    def execute_greedy(self, batch: PagedBatch, steps: int, *, lora: torch.Tensor | None = None) -> list[list[int]]:
        raise RuntimeError("the CUDA runner takes one step per call: max_steps() is 1")
