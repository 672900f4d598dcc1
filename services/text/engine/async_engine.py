"""``AsyncLLMEngine``: the engine's step loop on a worker thread, so the serving event loop never blocks and
every concurrent ``stream`` call shares one continuous batch.

Deltas cross from the engine thread to the event loop through a mailbox per loop: every delta posted before the loop
wakes rides on one wake-up (one ``call_soon_threadsafe`` per engine step, not one per stream), and a stream whose
consumer fell behind receives what waits for it as one merged delta (``Delta.then``), so a slow writer sends one
message per wake-up instead of one per token, in order and never later than it would have.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import torch

from genserve.services.common.weights import committed_weights
from genserve.services.text.engine.engine import EngineConfig, LLMEngine
from genserve.services.text.engine.params import Delta, SamplingParams
from genserve.services.text.engine.progress import DEFAULT_STALL_S, StallDetector

DEMO_DIR = committed_weights("text")
ENGINE_THREAD = "genserve-text-engine"


class _Mailbox:
    """Deltas posted from any thread to one event loop's stream queues, delivered in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[Delta], Delta]] = []

    def post(self, queue: asyncio.Queue[Delta], delta: Delta) -> None:
        with self._lock:
            self._items.append((queue, delta))
            if len(self._items) > 1:
                return  # the wake-up scheduled with the first item delivers this one too
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed; nobody is listening
            with self._lock:
                self._items.clear()

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, delta in items:
            queue.put_nowait(delta)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, source: str = "", quantization: str = "",
                 stall_s: float = DEFAULT_STALL_S):
        self.engine = engine
        self.source = source  # the file or directory the weights came from
        self.quantization = quantization  # the checkpoint's own weight type, e.g. "Q4_1" for a GGUF file
        self.tokenizer = engine.tokenizer
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.progress = StallDetector(stall_s)
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()

    @classmethod
    def from_dir(cls, path: str | Path | None = None, *, dtype: str = "auto", config: EngineConfig | None = None,
                 device: str | None = None, stall_s: float = DEFAULT_STALL_S) -> AsyncLLMEngine:
        """Load a checkpoint directory or GGUF file (``None`` -> the committed demo model) into a ready engine on
        ``device`` (default: the replica's, ``services/common/device.py``). ``dtype`` "auto" is bfloat16 on CUDA and
        float32 on the CPU.

        The loading runs on the engine's own thread, which then steps it, so that one thread runs every parallel op
        of the model (loading, prefill, the fused decode step). libgomp keeps a team of workers for each thread that
        opens parallel regions, and once a process holds more of them than it has cores it stops spinning at
        barriers and sleeps on a futex at each one: with the weights loaded on the replica's own thread, a decoded
        token cost 269 context switches in the replica (docs/benchmarks.md, "Where a token's time goes")."""
        loaded: list[AsyncLLMEngine | BaseException] = []
        ready = threading.Event()

        def load_then_step() -> None:
            try:
                loaded.append(cls._load(path, dtype, config, device, stall_s))
            except BaseException as exc:  # raised again in the caller's thread
                loaded.append(exc)
                return
            finally:
                ready.set()
            loaded[0]._loop()

        thread = threading.Thread(target=load_then_step, name=ENGINE_THREAD, daemon=True)
        thread.start()
        ready.wait()
        if isinstance(loaded[0], BaseException):
            raise loaded[0]
        loaded[0]._thread = thread
        return loaded[0]

    @classmethod
    def _load(cls, path: str | Path | None, dtype: str, config: EngineConfig | None, device: str | None,
              stall_s: float) -> AsyncLLMEngine:
        from genserve.services.common.device import serving_device
        from genserve.services.text.loader import load_model, open_gguf
        from genserve.services.text.model import LlamaForCausalLM
        from genserve.services.text.tokenizer import TextTokenizer
        from genserve.shared.blocks.quant_linear import QuantLinear

        root = (Path(path) if path is not None else DEMO_DIR).resolve()
        device = device or serving_device()
        # "auto" keeps a GGUF file's Q8_0/Q4_0/Q4_1 matrices in their own blocks; an explicit dtype dequantizes all.
        keep_quantized = dtype == "auto"
        if dtype == "auto":
            dtype = "bfloat16" if torch.device(device).type == "cuda" else "float32"

        def load(source: Path) -> tuple[LlamaForCausalLM, TextTokenizer, Path, str, str]:
            """The model, its tokenizer, the path it came from, its name and its GGUF weight type ("" if
            dequantised)."""
            gguf = open_gguf(source)  # opened once: parsing a GGUF's metadata takes seconds for a 49k vocabulary
            if gguf is None:
                model = load_model(source, dtype, device=device)
                return model, TextTokenizer.from_dir(source, model.config.eos_token_ids), source, source.name, ""
            model = load_model(gguf, dtype, device=device, keep_quantized=keep_quantized)
            quantized = any(isinstance(m, QuantLinear) for m in model.modules())
            return (model, TextTokenizer.from_gguf(gguf, model.config.eos_token_ids), gguf.path, gguf.path.stem,
                    gguf.file_type if quantized else "")

        model, tokenizer, source, name, quantization = load(root)
        draft = None
        spec = config.speculative if config is not None else None
        if spec is not None and spec.method == "draft":
            draft, draft_tokenizer, draft_source, _, _ = load(Path(spec.draft_model_dir).resolve())
            if draft_tokenizer.backend.get_vocab() != tokenizer.backend.get_vocab():
                raise ValueError(f"speculative.draft_model_dir: {draft_source} has another tokenizer than "
                                 f"{source}; a draft model must share the target's vocabulary")
        return cls(LLMEngine(model, tokenizer, config, model_name=name, draft_model=draft), str(source),
                   quantization, stall_s=stall_s)

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def stalled(self) -> bool:
        """Work waits and no step has finished for `progress.stall_s` (services/text/engine/progress.py)."""
        return self.progress.stalled(self.engine.has_work())

    @property
    def kv_blocks_free(self) -> int:
        """Free KV-cache blocks now: the cheap gauge, without the parameter count that `info()` adds."""
        return self.engine.kv_blocks_free

    def info(self) -> dict:
        cfg = self.engine.model.config
        spec = self.engine.speculation_stats()
        return {
            "model_name": self.engine.model_name,
            "architecture": cfg.architecture,
            "n_params": self.engine.model.num_params(),
            "vocab_size": cfg.vocab_size,
            "max_context": self.max_context,
            "dtype": cfg.dtype,
            "kv_blocks_free": self.kv_blocks_free,
            "model_path": self.source,
            "quantization": self.quantization,
            **self.engine.settings(),
            "spec_proposed_tokens": spec["proposed"],
            "spec_accepted_tokens": spec["accepted"],
            "spec_acceptance_rate": spec["acceptance_rate"],
            "forced_proposed_tokens": spec["forced_proposed"],
            "forced_accepted_tokens": spec["forced_accepted"],
        }

    # ---- the worker thread ----------------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=ENGINE_THREAD, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.engine.has_work():
                    self.progress.idle()
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.engine.step()
                self.progress.stepped()
            except BaseException as exc:  # surface model errors to every waiting request instead of hanging
                self.error = exc
                self.engine.fail_all(f"engine error: {type(exc).__name__}")

    def _notify(self) -> None:
        self._ensure_thread()
        with self._wake:
            self.progress.work_arrived()
            self._wake.notify()

    def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- requests -------------------------------------------------------------------------------------------
    async def stream(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, *,
                     interactive: bool = True) -> AsyncIterator[Delta]:
        """Yield a ``Delta`` per produced token as soon as the engine produces it (the tokens that waited for a
        busy consumer, merged into one); the last carries the finish_reason. Closing the iterator early (``aclose``,
        task cancellation) aborts the request. A model failure raises RuntimeError (never a traceback in a delta).
        ``interactive=False`` (a consumer that only wants the whole reply) lets greedy requests run lookahead steps
        (``LLMEngine.add_request``)."""
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        mailbox = self._mailboxes.get(loop) or self._mailboxes.setdefault(loop, _Mailbox(loop))
        queue: asyncio.Queue[Delta] = asyncio.Queue()

        def on_delta(delta: Delta) -> None:
            mailbox.post(queue, delta)

        # Compiling a grammar takes milliseconds to seconds: off the event loop, before the request exists.
        grammar = await asyncio.to_thread(self.engine.grammars.compile, params) if params.structured else None
        self.engine.add_request(request_id, prompt_ids, params, on_delta, interactive=interactive, grammar=grammar)
        self._notify()
        finished, held = False, None
        try:
            while not finished:
                delta, held = held or await queue.get(), None
                while delta.finish_reason is None and not queue.empty():  # what waits leaves as one delta
                    later = queue.get_nowait()
                    if later.finish_reason == "error":
                        held = later
                        break
                    delta = delta.then(later)
                finished = delta.finish_reason is not None
                if delta.finish_reason == "error":
                    raise RuntimeError(f"text {delta.text}")
                yield delta
        finally:
            if not finished:
                self.engine.abort(request_id)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
                 ) -> tuple[str, list[int], str]:
        """Blocking generation through the shared batch: (text, token_ids, finish_reason)."""
        done = threading.Event()
        deltas: list[Delta] = []

        def on_delta(delta: Delta) -> None:
            deltas.append(delta)
            if delta.finish_reason is not None:
                done.set()

        self.engine.add_request(request_id or uuid.uuid4().hex, prompt_ids, params, on_delta)
        self._notify()
        done.wait()
        if deltas[-1].finish_reason == "error":
            raise RuntimeError(f"text {deltas[-1].text}")
        return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], deltas[-1].finish_reason
