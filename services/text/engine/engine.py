"""The synchronous engine core: requests in, one continuous-batching step at a time, ``Delta``s out.

``step()`` schedules under a lock, hands the batch to the model runner without it (so ``abort`` from another
thread frees blocks at once), then detokenises and checks the finish conditions of every sequence that produced a
token. The engine only schedules: the runner (services/text/runners, chosen once at start-up) owns the weights,
the KV-cache tensors, the forward pass and sampling, and the engine never learns which device or kernel ran.

LoRA adapters (``EngineConfig.lora``): ``load_adapter``/``unload_adapter`` by name (engine/adapters.py), a request
names one in ``SamplingParams.adapter``, and each step puts the adapters of its rows into the runner's slots
(``_place_adapters``) and hands the runner every token's slot, so one batch mixes adapters and the base model.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from genserve.services.text.engine.adapters import AdapterRegistry, LoraConfig
from genserve.services.text.engine.batch import build_batch
from genserve.services.text.engine.detokenizer import IncrementalDetokenizer, StopChecker
from genserve.services.text.engine.draft import DraftProposer
from genserve.services.text.engine.grammar import Grammar, GrammarCompiler
from genserve.services.text.engine.kv_cache import BlockManager, KVGroup, block_bytes, blocks_held, kv_groups
from genserve.services.text.engine.params import (
    AdapterNotFound,
    Delta,
    EngineOverloaded,
    PromptTooLong,
    SamplingParams,
    TokenLogprob,
)
from genserve.services.text.engine.runner import ModelRunner
from genserve.services.text.engine.sampler import make_generator, sample_batch
from genserve.services.text.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from genserve.services.text.engine.sequence import Sequence
from genserve.services.text.engine.speculative import (
    MAX_BACKOFF,
    SpeculativeConfig,
    Verdict,
    next_draft_length,
    propose_ngram,
    verify,
)
from genserve.shared.blocks.paged import PagedBatch


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    # The paged cache's memory: kv_cache_bytes when > 0, else kv_cache_fraction (when > 0) of the device's memory as
    # the runner counts it (CUDA: the GPU's total; CPU: what is available), else the runner's default; never less
    # than one full-context request.
    kv_cache_bytes: int = 0
    kv_cache_fraction: float = 0.0
    num_blocks: int = 0  # overrides both when > 0 (tests)
    max_batched_tokens: int = 512
    max_running: int = 64
    max_waiting: int = 1024
    max_context: int = 0  # 0 -> the model's max_position
    # Greedy decode steps one runner call may run back to back (LLMEngine._lookahead; the CPU runner's fused step):
    # the Python between two steps costs ~6% of a step at batch 1 on the bench model. 1: every token at once.
    max_lookahead: int = 8
    cuda_graphs: bool = True
    # Automatic prefix caching (kv_cache.py): full blocks are shared across requests by the hash of their prefix.
    prefix_caching: bool = True
    # Hybrid allocation (kv_cache.py): sliding-window layers keep only their window's blocks, in block tables of
    # their own; False: one table for every layer, each holding the whole context.
    hybrid_kv_cache: bool = True
    # Exact speculative decoding with n-gram or draft-model drafts (engine/speculative.py); None: off.
    speculative: SpeculativeConfig | None = None
    # Jump-forward for grammar-constrained requests: up to this many tokens of the text the grammar forces next are
    # drafted and verified like speculative drafts (LLMEngine._propose); 0: off.
    max_jump_forward: int = 8
    # LoRA adapters (engine/adapters.py); None: none may be loaded, and the model runs without the LoRA hooks.
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_batched_tokens", "max_running", "max_waiting", "max_lookahead"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("kv_cache_bytes", "num_blocks", "max_context", "max_jump_forward"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.kv_cache_fraction < 1:
            raise ValueError(f"kv_cache_fraction must be in [0, 1), got {self.kv_cache_fraction}")
        if self.kv_cache_bytes and self.kv_cache_fraction:
            raise ValueError("give kv_cache_bytes or kv_cache_fraction, not both")


@dataclass(frozen=True)
class EngineCounters:
    hit_tokens: int  # prompt tokens admitted with their K/V already in the prefix cache
    queried_tokens: int  # prompt tokens admitted
    preemptions: int  # sequences preempted (blocks freed, to be recomputed) because the KV cache ran out


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None,
                 model_name: str = "model", runner: ModelRunner | None = None,
                 draft_model: torch.nn.Module | None = None):
        """``draft_model``: the drafting model of ``speculative.method == "draft"`` (engine/draft.py), loaded from
        ``speculative.draft_model_dir`` by the caller (AsyncLLMEngine.from_dir checks that its tokenizer is the
        target's)."""
        self.config = config = config or EngineConfig()
        spec = config.speculative
        if (spec is not None and spec.method == "draft") != (draft_model is not None):
            raise ValueError("a draft model is given exactly when speculative.method is 'draft'")
        from genserve.services.text.runners import make_runner

        if runner is None:
            runner = make_runner(model, max_lookahead=config.max_lookahead, max_running=config.max_running,
                                 cuda_graphs=config.cuda_graphs, lora=config.lora)
        self.runner = runner
        self.model = runner.model
        self.tokenizer = tokenizer
        self.model_name = model_name
        mc = self.model.config
        self.max_context = config.max_context or mc.max_position
        # A window as long as the context never lets a block go: such a layer is a full-attention one here.
        windows = [w if w < self.max_context else 0 for w in map(mc.layer_window, range(mc.n_layers))]
        groups = kv_groups(windows) if config.hybrid_kv_cache else (KVGroup(0, tuple(range(mc.n_layers))),)
        heads, width, values_apart = mc.kv_cache_layout
        # A block holds block_size tokens of one group's layers; every group has as many (kv_groups).
        per_block = block_bytes(config.block_size, len(groups[0].layers), heads, width, runner.kv_dtype,
                                values_apart)
        full_context = blocks_held([g.window for g in groups], config.block_size, self.max_context) * per_block
        num_blocks = config.num_blocks or runner.kv_cache_budget(
            config.kv_cache_bytes, config.kv_cache_fraction, full_context) // per_block
        if num_blocks <= 0:
            raise ValueError(f"the KV-cache budget holds no block of {per_block} bytes")
        self.kv_cache_bytes = num_blocks * per_block
        runner.allocate_kv_cache(num_blocks, config.block_size, groups)
        self.blocks = BlockManager(num_blocks, config.block_size, caching=config.prefix_caching, groups=groups)
        # The longest prompt one request may bring: what the cache holds for one sequence alone.
        self.capacity_tokens = self.blocks.capacity_tokens(self.max_context)
        # K/V bytes per token of every layer of each attention kind (GetModelInfo), and the tokens one sequence
        # alone could hold, not capped by the context (a sliding-only model: by the pool's size).
        per_layer = block_bytes(1, 1, heads, width, runner.kv_dtype, values_apart)
        self.kv_layer_kinds = [
            {"kind": "sliding_attention" if w else "full_attention", "window": w, "n_layers": windows.count(w),
             "kv_bytes_per_token": windows.count(w) * per_layer} for w in sorted(set(windows))]
        self.kv_tokens_fit = self.blocks.capacity_tokens(num_blocks * config.block_size)
        self.drafter: DraftProposer | None = None
        if draft_model is not None:
            # Multi-step greedy calls as long as a draft, where the runner has them (the CPU's fused step).
            self.drafter = DraftProposer(make_runner(draft_model, max_lookahead=max(config.max_lookahead,
                                                                                    spec.num_tokens + 1),
                                                     max_running=config.max_running, cuda_graphs=config.cuda_graphs),
                                         self.blocks, mc.vocab_size)
        self.scheduler = Scheduler(self.blocks, SchedulerConfig(
            config.max_batched_tokens, config.max_running, config.max_waiting,
            config.lora.max_loras if config.lora is not None else 0))
        self.registry: AdapterRegistry | None = None
        self._adapter_lock = threading.Lock()  # the registry's; never held while taking self.lock
        if config.lora is not None:
            from genserve.services.text.adapter_slots import adaptable_projections

            self.registry = AdapterRegistry(config.lora, {k: (m.in_features, m.out_features)
                                                          for k, m in adaptable_projections(self.model).items()})
            for name, folder in config.lora.adapters:
                self.registry.load(name, folder)
        self.eos_ids = frozenset(mc.eos_token_ids) | frozenset(getattr(tokenizer, "eos_token_ids", ()))
        self.grammars = GrammarCompiler(tokenizer, mc.vocab_size, self.eos_ids)
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.lock = threading.Lock()
        k = config.speculative.num_tokens if config.speculative is not None else 0
        self.spec_proposed = [0] * k  # drafts scored at each draft position since start-up
        self.spec_accepted = [0] * k  # ... and accepted
        self.forced_proposed = self.forced_accepted = 0  # jump-forward drafts scored and accepted

    # ---- LoRA adapters --------------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter in folder ``path`` (under the configured root) as ``name``; InvalidAdapter (outside
        the root, corrupt, or made for another base model), AdapterCapacityExceeded."""
        if self.registry is None:
            raise AdapterNotFound("this engine serves no LoRA adapters (no lora config)")
        with self._adapter_lock:
            self.registry.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Forget adapter ``name``: new requests naming it get AdapterNotFound, queued ones finish with it."""
        if self.registry is None:
            raise AdapterNotFound(f"adapter {name!r} is not loaded")
        with self._adapter_lock:
            self.registry.unload(name)

    def adapters(self) -> list[str]:
        """The names of the loaded adapters."""
        if self.registry is None:
            return []
        with self._adapter_lock:
            return self.registry.names()

    def adapter_folders(self) -> dict[str, Path]:
        """Each loaded adapter's folder (resolved), by name: what a replica compares with the app's shared names."""
        if self.registry is None:
            return {}
        with self._adapter_lock:
            return self.registry.folders()

    def _acquire_adapter(self, name: str):
        if not name:
            return None
        if self.registry is None:
            raise AdapterNotFound(f"adapter {name!r} is not loaded (this engine serves no LoRA adapters)")
        with self._adapter_lock:
            return self.registry.acquire(name)

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.adapter is not None and self.registry is not None:
            with self._adapter_lock:
                self.registry.release(seq.adapter)

    def _place_adapters(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Put the adapters of this step's rows into the runner's slots (a slot whose adapter no running sequence
        uses is reused; the scheduler keeps the running adapters within the slots) and return every token's slot
        (N,) int32, -1 for the base model, in ``build_batch``'s order; None for a step without adapters."""
        slots = self.runner.adapters
        if slots is None or all(c.seq.adapter is None for c in chunks):
            return None
        running = {id(s.adapter) for s in self.scheduler.running if s.adapter is not None}
        per_token: list[int] = []
        for c in chunks:
            adapter, slot = c.seq.adapter, -1
            if adapter is not None:
                slot = next((i for i, held in enumerate(slots.held) if held is adapter), -1)
                if slot < 0:
                    slot = next(i for i, held in enumerate(slots.held) if held is None or id(held) not in running)
                    slots.write(slot, adapter)
            per_token.extend([slot] * (c.length + len(c.draft)))
        return torch.tensor(per_token, dtype=torch.int32)

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    on_delta: Callable[[Delta], None], *, interactive: bool = False,
                    grammar: Grammar | None = None) -> None:
        """Queue a request; raises PromptTooLong, EngineOverloaded, InvalidJsonSchema, InvalidRegex, AdapterNotFound,
        AdapterCapacityExceeded, or ValueError (empty prompt, duplicate id). ``interactive``: a consumer that shows
        tokens as they come (a live stream) gets every token the moment it exists, never in lookahead bursts (see
        ``_lookahead``). A structured request's grammar is compiled here, in the caller's thread, unless ``grammar``
        is ``grammars.compile(params)``'s."""
        if not prompt_ids:
            raise ValueError("prompt must hold at least one token")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise PromptTooLong(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                f"the context of {self.max_context} tokens")
        if len(prompt_ids) + 1 > self.capacity_tokens:
            raise PromptTooLong(f"prompt ({len(prompt_ids)} tokens) exceeds the KV cache "
                                f"({self.capacity_tokens} tokens)")
        if grammar is None:
            grammar = self.grammars.compile(params)
        adapter = self._acquire_adapter(params.adapter)
        seq = Sequence(
            request_id=request_id, prompt_ids=list(prompt_ids), params=params,
            generator=make_generator(params.seed),
            detokenizer=IncrementalDetokenizer(self.tokenizer.decode, prompt_ids),
            stopper=StopChecker(params.stop), on_delta=on_delta, arrival=next(self._arrivals), interactive=interactive,
            grammar=grammar, adapter=adapter, long_rope=0 < self.model.rope.long_prompt_from < len(prompt_ids))
        try:
            with self.lock:
                if request_id in self._seqs:
                    raise ValueError(f"request_id {request_id!r} is already running")
                if len(self.scheduler.waiting) >= self.config.max_waiting:
                    raise EngineOverloaded(f"waiting queue is full ({self.config.max_waiting} requests)")
                self._seqs[request_id] = seq
                self.scheduler.add(seq)
        except (ValueError, EngineOverloaded):
            self._release_adapter(seq)
            raise

    def abort(self, request_id: str) -> bool:
        """Cancel a request and return its blocks to the free list now; False when it is unknown or finished."""
        with self.lock:
            seq = self._seqs.get(request_id)
            if seq is None:
                return False
            self._finish(seq, "cancelled")
        seq.on_delta(Delta(seq.stopper.take(final=True), (), "cancelled"))
        return True

    def fail_all(self, message: str) -> None:
        """End every request after a model error; consumers receive a final delta with reason ``error``."""
        with self.lock:
            seqs = list(self._seqs.values())
            for seq in seqs:
                self._finish(seq, "error")
        for seq in seqs:
            seq.on_delta(Delta(message, (), "error"))

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def kv_blocks_free(self) -> int:
        return self.blocks.num_free

    def settings(self) -> dict:
        """What took effect: the runner, its device and dtype, the KV cache and the scheduling limits."""
        return {
            "runner": self.runner.name,
            "device": str(self.runner.device),
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_layer_kinds": self.kv_layer_kinds,
            "kv_tokens_fit": self.kv_tokens_fit,
            "block_size": self.blocks.block_size,
            "max_batched_tokens": self.config.max_batched_tokens,
            "max_running": self.config.max_running,
            "max_lookahead": self.runner.max_steps(1),
            "prefix_caching": self.blocks.caching,
            "prefix_cache_hit_tokens": self.scheduler.hit_tokens,
            "speculative": self.config.speculative.method if self.config.speculative is not None else "off",
            "max_jump_forward": self.config.max_jump_forward,
            "lora_adapters": self.adapters(),
        }

    def speculation_stats(self) -> dict:
        """Drafted tokens scored and accepted since start-up, in total and per draft position, and the acceptance
        rate (accepted / proposed; 0 before any draft)."""
        proposed, accepted = sum(self.spec_proposed), sum(self.spec_accepted)
        return {"proposed": proposed, "accepted": accepted,
                "acceptance_rate": accepted / proposed if proposed else 0.0,
                "proposed_by_position": list(self.spec_proposed), "accepted_by_position": list(self.spec_accepted),
                "forced_proposed": self.forced_proposed, "forced_accepted": self.forced_accepted}

    def counters(self) -> EngineCounters:
        """The engine's running totals since start-up."""
        s = self.scheduler
        return EngineCounters(hit_tokens=s.hit_tokens, queried_tokens=s.queried_tokens, preemptions=s.num_preemptions)

    # ---- stepping -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> int:
        """Run one continuous-batching step; returns the number of tokens computed."""
        with self.lock:
            chunks = self.scheduler.schedule()
            overflowed = self.scheduler.overflowed
            for seq in overflowed:
                self._finish(seq, "context_length")
            if chunks:
                if self.config.speculative is not None or self.config.max_jump_forward:
                    chunks = self._propose(chunks)
                speculating = any(c.draft for c in chunks)
                steps = 1 if speculating else self._lookahead(chunks)
                batch, chunks = build_batch(chunks, self.blocks)
                lora = self._place_adapters(chunks)
        for seq in overflowed:
            seq.on_delta(Delta(seq.stopper.take(final=True), (), "context_length"))
        if not chunks:
            return 0
        if speculating:
            return self._verify_step(batch, chunks, lora)
        if steps > 1:
            return self._greedy_steps(batch, chunks, steps, lora)
        # Each sampled row's request carries its own options and seeded generator (Sequence is a SampleRow).
        sampled = iter(self.runner.execute(batch, [c.seq for c in chunks if c.sample], lora=lora))
        deltas: list[tuple[Sequence, Delta]] = []
        with self.lock:
            for c in chunks:
                token, logprob = next(sampled) if c.sample else (None, None)
                if c.seq.finished:  # aborted while the model ran
                    continue
                c.seq.num_computed = c.start + c.length
                self.blocks.register(c.seq.request_id, c.seq.prompt_ids, c.seq.output_ids, c.seq.num_computed)
                if c.sample:
                    deltas.append((c.seq, self._advance(c.seq, token, logprob)))
        for seq, delta in deltas:
            seq.on_delta(delta)
        return int(batch.input_ids.numel())

    def _propose(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Give each sampled one-token chunk a draft, with the blocks for its slots reserved now:
        * a grammar-constrained request, the tokens its grammar forces next (jump-forward; up to
          ``max_jump_forward``), which the model nearly always accepts: a tool call's keys and punctuation cost no
          steps of their own;
        * otherwise, with speculation on, an n-gram draft (Saxena 2023) or the draft model's (engine/draft.py, one
          pass for every such sequence) of up to ``num_tokens`` tokens, cut to the prefix the request's grammar
          allows; none when more than ``max_batch`` sequences decode this step, none for a request that opted out,
          and none while the sequence backs off after rejected drafts (``_verify_step``).
        A draft never reaches past ``max_tokens`` or the context, nor the step's token budget, nor, in a decode-only
        step, the rows the runner's fast path takes (``runner.draft_rows``: the CPU's fused step takes 16), and is
        dropped when the free blocks run short."""
        spec = self.config.speculative
        speculate = spec is not None and sum(1 for c in chunks if c.sample and c.length == 1) <= spec.max_batch
        budget = self.config.max_batched_tokens - sum(c.length for c in chunks)
        if all(c.length == 1 for c in chunks):  # a decode-only step: keep it on the runner's fast path
            budget = min(budget, self.runner.draft_rows(len(chunks)))
        drafts: dict[int, tuple[list[int], bool]] = {}  # chunk index -> (draft, forced)
        wanted: dict[int, list[int]] = {}  # draft length -> the chunks the draft model drafts for, blocks reserved
        for i, c in enumerate(chunks):
            seq = c.seq
            if c.length != 1 or not c.sample:
                continue
            room = min(budget, seq.params.max_tokens - len(seq.output_ids) - 1, self.max_context - seq.num_tokens - 1)
            draft = seq.grammar.forced_tokens(min(room, self.config.max_jump_forward)) if seq.grammar else []
            forced = bool(draft)
            if not forced and speculate and seq.params.speculative and seq.spec_skip == 0 and room > 0:
                k = min(seq.spec_k or spec.num_tokens, room)
                if self.drafter is not None:
                    # The draft model writes K/V up to its k-th draft: the blocks are reserved before it runs.
                    if self.blocks.can_grow(seq.request_id, seq.num_tokens + k):
                        self.blocks.grow(seq.request_id, seq.num_tokens + k)
                        wanted.setdefault(k, []).append(i)
                        budget -= k
                    continue
                draft = propose_ngram(seq.tokens, k, spec.ngram_min, spec.ngram_max)
                if seq.grammar is not None:
                    draft = seq.grammar.allowed_prefix(draft)
            elif not forced:
                seq.spec_skip = max(0, seq.spec_skip - 1)
            if draft and self.blocks.can_grow(seq.request_id, seq.num_tokens + len(draft)):
                self.blocks.grow(seq.request_id, seq.num_tokens + len(draft))
                budget -= len(draft)
                drafts[i] = (draft, forced)
        for k, indices in wanted.items():  # one draft pass per draft length: one in all but the last steps
            for i, draft in zip(indices, self.drafter.propose([chunks[i].seq for i in indices], k), strict=True):
                seq = chunks[i].seq
                draft = seq.grammar.allowed_prefix(draft) if seq.grammar is not None else draft
                if draft:
                    drafts[i] = (draft, False)
                else:  # the reserved blocks go back, and the drafts' K/V with them
                    self.blocks.truncate(seq.request_id, seq.num_tokens)
                    seq.draft_computed = seq.num_tokens
        return [ScheduledChunk(c.seq, c.start, 1, tuple(drafts[i][0]), drafts[i][1]) if i in drafts else c
                for i, c in enumerate(chunks)]

    def _verify_step(self, batch: PagedBatch, chunks: list[ScheduledChunk], lora: torch.Tensor | None) -> int:
        """One step with speculative drafts: score every sampled position (``runner.execute_logits``: a draft chunk
        is k + 1 decode rows, engine/batch.py), sample the chunks without a draft as
        ``sample_batch`` does, verify each draft (Leviathan et al. 2023; Chen et al. 2023), then, per sequence: keep
        the K/V of its accepted tokens, give the blocks past them back, and emit the accepted drafts and the
        corrected or bonus token one by one, up to the one that finishes it (EOS, a stop string, ``max_tokens``)."""
        logits = self.runner.execute_logits(batch, lora=lora)  # (S, V): one row per sampled position
        row = 0
        spans: list[tuple[int, int]] = []
        for c in chunks:
            n = 1 + len(c.draft) if c.sample else 0
            spans.append((row, n))
            row += n
        plain = [i for i, c in enumerate(chunks) if c.sample and not c.draft]
        sampled = {}
        if plain:
            index = torch.tensor([spans[i][0] for i in plain], device=logits.device)
            sampled = dict(zip(plain, sample_batch(logits[index], [chunks[i].seq for i in plain]), strict=True))
        verdicts: dict[int, Verdict] = {}
        for i, c in enumerate(chunks):
            if c.draft and not c.seq.finished:
                start, n = spans[i]
                verdicts[i] = verify(logits[start:start + n], c.seq, list(c.draft))
        deltas: list[tuple[Sequence, Delta]] = []
        with self.lock:
            for i, c in enumerate(chunks):
                seq = c.seq
                if seq.finished:  # aborted while the model ran
                    continue
                if not c.draft:
                    seq.num_computed = c.start + c.length
                    self.blocks.register(seq.request_id, seq.prompt_ids, seq.output_ids, seq.num_computed)
                    if c.sample:
                        deltas.append((seq, self._advance(seq, *sampled[i])))
                    continue
                verdict = verdicts[i]
                if c.forced:
                    self.forced_proposed += len(c.draft)
                    self.forced_accepted += verdict.accepted
                else:
                    # Back off where drafts keep failing (open-ended text): after n passes in a row that accepted
                    # nothing, the next min(2^n, MAX_BACKOFF) steps run without a draft; and the draft length
                    # follows the acceptances (adaptive k).
                    seq.spec_misses = 0 if verdict.accepted else seq.spec_misses + 1
                    seq.spec_skip = min(1 << seq.spec_misses, MAX_BACKOFF) if seq.spec_misses else 0
                    most = self.config.speculative.num_tokens
                    seq.spec_k = next_draft_length(seq.spec_k or most, len(c.draft), verdict.accepted, most)
                    for j in range(len(c.draft)):
                        self.spec_proposed[j] += 1
                        self.spec_accepted[j] += j < verdict.accepted
                # K/V stays valid for the newest token and the accepted drafts; the rejected slots' blocks go back.
                seq.num_computed = c.start + 1 + verdict.accepted
                seq.draft_computed = min(seq.draft_computed, seq.num_computed)
                self.blocks.truncate(seq.request_id, seq.num_computed)
                for j, token in enumerate(verdict.tokens):
                    logprob = verdict.logprobs[j] if verdict.logprobs is not None else None
                    deltas.append((seq, self._advance(seq, token, logprob)))
                    if seq.finished:
                        break
                if not seq.finished:
                    self.blocks.register(seq.request_id, seq.prompt_ids, seq.output_ids, seq.num_computed)
        for seq, delta in deltas:
            seq.on_delta(delta)
        return int(batch.input_ids.numel())

    def _lookahead(self, chunks: list[ScheduledChunk]) -> int:
        """How many decode steps this batch runs in one runner call (up to ``runner.max_steps``), with the blocks
        for the extra positions reserved here; 1 is an ordinary step. Several only when they cannot change what
        anyone receives: every chunk a decode token of a plain greedy request (no penalties, no logprobs, no
        grammar) that nobody watches token by token (not ``interactive``), nobody waiting to be admitted, and no
        sequence due to stop on length or context sooner. A sequence that stops early on EOS or a stop string drops
        the tokens after it, so its output is the same as step by step; its deltas arrive in bursts of up to
        ``config.max_lookahead``."""
        max_steps = self.runner.max_steps(len(chunks))
        if (max_steps <= 1 or self.scheduler.waiting
                or any(c.length != 1 or c.seq.interactive or not c.seq.params.greedy or c.seq.params.has_penalties
                       or c.seq.params.logprobs or c.seq.grammar is not None for c in chunks)):
            return 1
        steps = min(max_steps, *(min(c.seq.params.max_tokens - len(c.seq.output_ids),
                                     self.max_context - c.seq.num_tokens) for c in chunks))
        if steps <= 1 or not self.scheduler.reserve_ahead([c.seq for c in chunks], steps - 1):
            return 1
        return steps

    def _greedy_steps(self, batch: PagedBatch, chunks: list[ScheduledChunk], steps: int,
                      lora: torch.Tensor | None) -> int:
        """Run ``steps`` greedy decode steps in one runner call and hand each sequence its tokens in order, as
        ``steps`` ordinary steps would, up to the one that finishes it."""
        rows = self.runner.execute_greedy(batch, steps, lora=lora)  # (M, steps) token ids
        deltas: list[tuple[Sequence, Delta]] = []
        with self.lock:
            for c, tokens in zip(chunks, rows, strict=True):
                for j, token in enumerate(tokens):
                    if c.seq.finished:  # aborted while the model ran, or finished by an earlier token
                        break
                    c.seq.num_computed = c.start + j + 1
                    self.blocks.register(c.seq.request_id, c.seq.prompt_ids, c.seq.output_ids, c.seq.num_computed)
                    deltas.append((c.seq, self._advance(c.seq, token, None)))
        for seq, delta in deltas:
            seq.on_delta(delta)
        return len(chunks) * steps

    def _advance(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> Delta:
        """Append ``seq``'s next token, detokenise it and check every finish condition. A structured request ends
        with ``stop`` when its grammar is done (a stop token it allowed, or nothing else may follow)."""
        seq.output_ids.append(token)
        if seq.grammar is not None and not seq.grammar.accept(token):
            self._finish(seq, "error")  # the mask allowed it, so this is a bug: end this request only
            return Delta(f"the grammar rejected token {token}", (token,), "error")
        reason = None
        if token in self.eos_ids:
            reason = "eos" if seq.grammar is None else "stop"
        elif seq.stopper.add(seq.detokenizer.add(token)) or (seq.grammar is not None and seq.grammar.done):
            reason = "stop"
        elif len(seq.output_ids) >= seq.params.max_tokens:
            reason = "length"
        elif seq.num_tokens >= self.max_context:
            reason = "context_length"
        if reason is not None:
            self._finish(seq, reason)
        return Delta(seq.stopper.take(final=reason is not None), (token,), reason,
                     (logprob,) if logprob is not None else ())

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)
        self._release_adapter(seq)

    # ---- offline --------------------------------------------------------------------------------------------
    def generate_batch(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                       ) -> list[tuple[str, list[int], str]]:
        """Run ``prompts`` together in this thread until all finish: [(text, token_ids, finish_reason)]."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        results: list[list[Delta]] = [[] for _ in prompts]
        base = next(self._arrivals)
        for i, (ids, p) in enumerate(zip(prompts, plist, strict=True)):
            self.add_request(f"offline-{base}-{i}", ids, p, results[i].append)
        while any(not r or r[-1].finish_reason is None for r in results):
            self.step()
        return [("".join(d.text for d in r), [t for d in r for t in d.token_ids], r[-1].finish_reason)
                for r in results]
