"""The synchronous engine core: requests in, one continuous-batching step at a time, ``Delta``s out.

``step()`` schedules under a lock, runs the model without it (so ``abort`` from another thread frees blocks at
once), then samples, detokenises and checks the finish conditions of every sequence that produced a token.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.text.cpu_decode import CpuDecoder
from services.text.engine.batch import build_batch
from services.text.engine.detokenizer import IncrementalDetokenizer, StopChecker
from services.text.engine.kv_cache import PagedKVCache, blocks_for_budget
from services.text.engine.params import Delta, EngineOverloaded, PromptTooLong, SamplingParams, TokenLogprob
from services.text.engine.sampler import make_generator, sample_one
from services.text.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from services.text.engine.sequence import Sequence
from services.text.paged import PagedBatch


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    kv_cache_bytes: int = 256 * 2**20  # memory budget for the paged cache
    num_blocks: int = 0  # overrides kv_cache_bytes when > 0
    max_batched_tokens: int = 512
    max_running: int = 64
    max_waiting: int = 1024
    max_context: int = 0  # 0 -> the model's max_position
    # Greedy decode steps one fused CPU kernel call may run back to back (LLMEngine._lookahead): the Python between
    # two steps costs ~6% of a step at batch 1 on the bench model. 1 streams every token the moment it exists.
    max_lookahead: int = 8

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_bytes", "max_batched_tokens", "max_running", "max_waiting",
                     "max_lookahead"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_blocks < 0 or self.max_context < 0:
            raise ValueError("num_blocks and max_context must be >= 0")


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None,
                 model_name: str = "model"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.model_name = model_name
        mc = model.config
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        num_blocks = self.config.num_blocks or blocks_for_budget(
            self.config.kv_cache_bytes, self.config.block_size, mc.n_layers, mc.n_kv_heads, mc.head_dim, dtype)
        self.cache = PagedKVCache(mc.n_layers, num_blocks, self.config.block_size, mc.n_kv_heads, mc.head_dim,
                                  dtype=dtype, device=device)
        self.scheduler = Scheduler(self.cache.manager, SchedulerConfig(
            self.config.max_batched_tokens, self.config.max_running, self.config.max_waiting))
        self.max_context = self.config.max_context or mc.max_position
        self.eos_ids = frozenset(mc.eos_token_ids) | frozenset(getattr(tokenizer, "eos_token_ids", ()))
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.lock = threading.Lock()
        self.cpu_decoder = CpuDecoder.for_model(model)  # decode-only steps on the CPU: one kernel call per layer

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    on_delta: Callable[[Delta], None], *, interactive: bool = False) -> None:
        """Queue a request; raises PromptTooLong, EngineOverloaded, or ValueError (empty prompt, duplicate id).
        ``interactive``: a consumer that shows tokens as they come (a live stream) gets every token the moment it
        exists, never in lookahead bursts (see ``_lookahead``)."""
        if not prompt_ids:
            raise ValueError("prompt must hold at least one token")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise PromptTooLong(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                f"the context of {self.max_context} tokens")
        if len(prompt_ids) + 1 > self.scheduler.capacity_tokens:
            raise PromptTooLong(f"prompt ({len(prompt_ids)} tokens) exceeds the KV cache "
                                f"({self.scheduler.capacity_tokens} tokens)")
        seq = Sequence(
            request_id=request_id, prompt_ids=list(prompt_ids), params=params,
            generator=make_generator(params.seed),
            detokenizer=IncrementalDetokenizer(self.tokenizer.decode, prompt_ids),
            stopper=StopChecker(params.stop), on_delta=on_delta, arrival=next(self._arrivals), interactive=interactive)
        with self.lock:
            if request_id in self._seqs:
                raise ValueError(f"request_id {request_id!r} is already running")
            if len(self.scheduler.waiting) >= self.config.max_waiting:
                raise EngineOverloaded(f"waiting queue is full ({self.config.max_waiting} requests)")
            self._seqs[request_id] = seq
            self.scheduler.add(seq)

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
        return self.cache.manager.num_free

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
                steps = self._lookahead(chunks)
                batch, chunks = build_batch(chunks, self.cache)
        for seq in overflowed:
            seq.on_delta(Delta(seq.stopper.take(final=True), (), "context_length"))
        if not chunks:
            return 0
        if steps > 1:
            return self._greedy_steps(batch, chunks, steps)
        # Sampling runs on the CPU with each request's own generator.
        fused = self.cpu_decoder is not None and not batch.prefills and batch.n_decode <= CpuDecoder.max_tokens
        forward = self.cpu_decoder if fused else self.model.forward_paged
        logits = forward(batch, self.cache.k, self.cache.v).float().cpu()  # (S, V)
        deltas: list[tuple[Sequence, Delta]] = []
        with self.lock:
            row = 0
            for c in chunks:
                if c.sample:
                    row += 1
                if c.seq.finished:  # aborted while the model ran
                    continue
                c.seq.num_computed = c.start + c.length
                if c.sample:
                    token, logprob = sample_one(logits[row - 1], c.seq.params, c.seq.generator, c.seq.prompt_ids,
                                                c.seq.output_ids)
                    deltas.append((c.seq, self._advance(c.seq, token, logprob)))
        for seq, delta in deltas:
            seq.on_delta(delta)
        return int(batch.input_ids.numel())

    def _lookahead(self, chunks: list[ScheduledChunk]) -> int:
        """How many decode steps this batch runs in one fused kernel call, with the blocks for the extra positions
        reserved here; 1 is an ordinary step. Several only when they cannot change what anyone receives: every
        chunk a decode token of a plain greedy request (no penalties, no logprobs) that nobody watches token by
        token (not ``interactive``), nobody waiting to be admitted, and no sequence due to stop on length or
        context sooner. A sequence that stops early on EOS or a stop string drops the tokens after it, so its
        output is the same as step by step; its deltas arrive in bursts of up to ``config.max_lookahead``."""
        if (self.cpu_decoder is None or self.scheduler.waiting or len(chunks) > CpuDecoder.max_tokens
                or any(c.length != 1 or c.seq.interactive or not c.seq.params.greedy or c.seq.params.has_penalties
                       or c.seq.params.logprobs for c in chunks)):
            return 1
        steps = min(self.config.max_lookahead, *(min(c.seq.params.max_tokens - len(c.seq.output_ids),
                                         self.max_context - c.seq.num_tokens) for c in chunks))
        if steps <= 1 or not self.scheduler.reserve_ahead([c.seq for c in chunks], steps - 1):
            return 1
        return steps

    def _greedy_steps(self, batch: PagedBatch, chunks: list[ScheduledChunk], steps: int) -> int:
        """Run ``steps`` greedy decode steps in one kernel call and hand each sequence its tokens in order, as
        ``steps`` ordinary steps would, up to the one that finishes it."""
        rows = self.cpu_decoder.greedy(batch, steps, self.cache.k, self.cache.v)  # (M, steps) token ids
        deltas: list[tuple[Sequence, Delta]] = []
        with self.lock:
            for c, tokens in zip(chunks, rows, strict=True):
                for j, token in enumerate(tokens):
                    if c.seq.finished:  # aborted while the model ran, or finished by an earlier token
                        break
                    c.seq.num_computed = c.start + j + 1
                    deltas.append((c.seq, self._advance(c.seq, token, None)))
        for seq, delta in deltas:
            seq.on_delta(delta)
        return len(chunks) * steps

    def _advance(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> Delta:
        """Append ``seq``'s next token, detokenise it and check every finish condition."""
        seq.output_ids.append(token)
        reason = None
        if token in self.eos_ids:
            reason = "eos"
        elif seq.stopper.add(seq.detokenizer.add(token)):
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
