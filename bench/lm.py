"""Text engine vs Hugging Face transformers on the same random Llama (issue 5, done-when 3).

    .venv/bin/python bench/lm.py [--repeats 3] [--threads 2] [--small] [--prefix-only]

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
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from services.text.engine import EngineConfig, LLMEngine, SamplingParams
from services.text.loader import load_model

FULL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=1024)
SMALL = dict(FULL, hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=4096)
PROMPT_LEN, NEW_TOKENS, CONCURRENT = 32, 128, 16
SYSTEM_LEN, USER_LEN = 512, 32


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


def hf_checkpoint(cfg: dict, directory: Path):
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, eos_token_id=None, bos_token_id=None,
                                                                   pad_token_id=0)).eval()
    model.save_pretrained(directory)
    return model


def engine_for(directory: Path, dtype: str, max_lookahead: int, prefix_caching: bool = False) -> LLMEngine:
    """(a)-(c) measure compute and send the same prompts every repeat: their engines run without prefix caching."""
    return LLMEngine(load_model(directory, dtype), NullTokenizer(),
                     EngineConfig(block_size=16, max_batched_tokens=512, max_lookahead=max_lookahead,
                                  prefix_caching=prefix_caching))


def stats(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def fmt(xs: list[float], unit: str = "") -> str:
    med, lo, hi = stats(xs)
    return f"{med:8.1f}{unit} ({lo:.1f}-{hi:.1f})"


# ---- (a) batch-1 decode -------------------------------------------------------------------------------------
def hf_decode_tps(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
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


def engine_concurrent(engine: LLMEngine, prompts: list[list[int]], budgets: list[int]) -> tuple[float, list[float]]:
    first: dict[int, float] = {}
    counts = [0] * len(prompts)
    t0 = now()
    for i, (p, m) in enumerate(zip(prompts, budgets, strict=True)):
        def on_delta(d, i=i):
            first.setdefault(i, now())
            counts[i] += len(d.token_ids)
        engine.add_request(f"b{i}-{t0}", p, SamplingParams(max_tokens=m, temperature=0), on_delta)
    while engine.has_work():
        engine.step()
    total = now() - t0
    return sum(counts) / total, [first[i] - t0 for i in range(len(prompts))]


def hf_static_batch(model, prompts: list[list[int]], budgets: list[int]) -> tuple[float, list[float]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
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
    """Every matrix is read once per decode step (int8 ones with their scales); the embedding contributes one
    row. RoPE tables are buffers too, but only one row of them is read."""
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    total += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith(("weight", "scales")))
    emb = model.model.embed_tokens.weight
    if model.lm_head.weight.data_ptr() == emb.data_ptr():  # tied: the LM head reads the whole embedding
        total += emb.numel() * emb.element_size()
    return total + emb.shape[1] * emb.element_size()


# ---- perplexity change of bf16 weights on the demo model ------------------------------------------------------
def demo_perplexities(max_tokens: int = 8192) -> dict[str, float] | None:
    from services.text import corpus
    from services.text.engine.async_engine import DEMO_DIR
    from services.text.tokenizer import TextTokenizer

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="a tiny config, to smoke-test the script")
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="wall")
    parser.add_argument("--max-lookahead", type=int, default=EngineConfig.max_lookahead,
                        help="greedy decode steps per fused kernel call (1: one step per call)")
    parser.add_argument("--prefix-only", action="store_true", help="run (d), the prefix-caching TTFT, alone")
    args = parser.parse_args()
    _clock[0] = _CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    cfg = SMALL if args.small else FULL
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_checkpoint(cfg, Path(tmp))
        cached_engine = engine_for(Path(tmp), "float32", args.max_lookahead, prefix_caching=True)
        if args.prefix_only:
            print(f"config: {cfg}, {args.threads} threads, {args.repeats} repeats, {args.clock} clock")
            print(prefix_report(cached_engine, cfg["vocab_size"], args.repeats))
            return 0
        engines = {f"engine {short}": engine_for(Path(tmp), dtype, args.max_lookahead)
                   for short, dtype in (("fp32", "float32"), ("bf16", "bfloat16"), ("int8", "int8"))}
    prompt = torch.randint(1, cfg["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts, budgets = mixed_requests(cfg["vocab_size"])
    decode: dict[str, list[float]] = {"HF fp32": [], **{k: [] for k in engines}}
    conc: dict[str, list[float]] = {"HF fp32": [], **{k: [] for k in engines}}
    ttft: dict[str, list[list[float]]] = {"HF fp32": [], **{k: [] for k in engines}}
    bandwidth: dict[str, list[float]] = {"HF fp32": [], **{k: [] for k in engines}}  # GB/s right before each run
    for r in range(args.repeats):
        print(f"repeat {r + 1}/{args.repeats}", file=sys.stderr, flush=True)
        bandwidth["HF fp32"].append(copy_bandwidth_gbs())
        decode["HF fp32"].append(hf_decode_tps(hf, prompt))
        for name, eng in engines.items():
            bandwidth[name].append(copy_bandwidth_gbs())
            decode[name].append(engine_decode_tps(eng, prompt))
        tps, firsts = hf_static_batch(hf, prompts, budgets)
        conc["HF fp32"].append(tps)
        ttft["HF fp32"].append(firsts)
        for name, eng in engines.items():
            tps, firsts = engine_concurrent(eng, prompts, budgets)
            conc[name].append(tps)
            ttft[name].append(firsts)

    hf_dec, hf_conc = stats(decode["HF fp32"])[0], stats(conc["HF fp32"])[0]
    print(f"config: {cfg}, fp32 checkpoint, {args.threads} threads, {args.repeats} repeats, {args.clock} clock, "
          f"engine max_lookahead {args.max_lookahead}; "
          f"copy bandwidth {fmt([b for v in bandwidth.values() for b in v], ' GB/s')}")
    print(f"{'system':<12} | {'(a) b=1 decode tok/s':<26} | {'x HF':>5} | {'(b) 16-mixed tok/s':<26} | {'x HF':>5} | "
          f"{'TTFT p50 s':>10} | {'TTFT p99 s':>10} | {'(c) % roofline':>14}")
    for name in decode:
        model = hf if name == "HF fp32" else engines[name].model
        wbytes = weight_bytes_per_step(model)
        roofs = [b * 1e9 / wbytes for b in bandwidth[name]]  # tok/s if every step ran at copy bandwidth
        roof = statistics.median(roofs)
        share = statistics.median(100 * t / r for t, r in zip(decode[name], roofs, strict=True))
        p50 = statistics.median(percentile(t, 0.5) for t in ttft[name])
        p99 = statistics.median(percentile(t, 0.99) for t in ttft[name])
        d, c = stats(decode[name])[0], stats(conc[name])[0]
        print(f"{name:<12} | {fmt(decode[name]):<26} | {d / hf_dec:5.2f} | {fmt(conc[name]):<26} | "
              f"{c / hf_conc:5.2f} | {p50:10.3f} | {p99:10.3f} | {share:8.1f}% of {roof:.0f}")
        print(f"{'':<12}   weights read per decode step: {wbytes / 2**20:.1f} MiB")
    print(prefix_report(cached_engine, cfg["vocab_size"], args.repeats))
    ppl = demo_perplexities()
    if ppl is not None:
        base = ppl["float32"]
        print("demo-model validation perplexity: " + ", ".join(
            f"{k} {v:.3f} ({100 * (v / base - 1):+.2f}%)" for k, v in ppl.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
