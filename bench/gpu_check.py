"""`make gpu-check`: every GPU check in one run, printed as one table (issue 13). Run it first whenever a GPU is at
hand, and record the dated table in docs/benchmarks.md.

    .venv/bin/python bench/gpu_check.py [--dry] [--skip-tests]
    bash bench/gpu_device.sh            # on the GPU check machine, as it is (docs/benchmarks.md, issue 37)

``--device-run`` (what bench/gpu_device.sh passes) runs from the checkout without installing it, on the machine's
own python3, torch and Triton plus the wheels bench/gpu_prepare.py carried (never Ray): genserve is linked from the
checkout's folders into a temporary folder put first on the path, and the GPU-only tests' autotuners try one
candidate each (GENSERVE_AUTOTUNE_CONFIGS=1), so a cold Triton cache fits the run in its 6 minutes.

Rows, each with our figure, the reference's, the ratio and the goal:
- the GPU-only tests (`pytest -m gpu`): compiled Triton kernels at production sizes, the CUDA runner against
  transformers;
- flash attention (bf16, D=128, causal, N = 2k and 4k) against the faster of torch SDPA's flash and cuDNN backends;
  goal >= 1.0x;
- paged decode (bf16, Llama-3-8B heads, 16k context, batch 32) as a share of the measured copy bandwidth; goal >= 70%;
- the sampler at 64 rows of Llama 3's vocabulary, every row top-p (a full sort and an fp64 draw), against greedy;
- the text engine in bf16 against transformers on the same GPU and the same random 1.1B Llama (TinyLlama's shape),
  prefix caching off (the warm-up sends the same prompt): batch-1 decode, and 64 concurrent requests (mixed
  64-512-token prompts, 128 new tokens each, greedy) against transformers' left-padded static batch of 64; goal >= 2x
  at 64; and the engine's greedy tokens checked against transformers by teacher forcing (each token scored by HF's
  logits given the engine's own history, so one near-tie does not derail the rest of a sequence);
- the diffusion pipeline (20 DDIM steps with guidance) against a diffusers UNet2DConditionModel of the same shape,
  both timed to a CUDA synchronize.

``--dry`` runs the same code on the CPU with tiny sizes (Triton under TRITON_INTERPRET=1), so the script cannot rot:
`make test` runs it that way. Its figures mean nothing; its rows must all be there.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    # Run as a file: `bench` and `tests` import from the repository root, appended so that its folders never shadow an
    # installed distribution's top-level package (Hugging Face's `kernels`, which transformers imports).
    sys.path.append(str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# TinyLlama-1.1B's shape with random weights: big enough that a GPU is busy, small enough to load in seconds. Weights
# of std 0.08 (HF's default is 0.02) give logits a spread of a few units, so greedy choices are seldom near-ties.
TEXT_GPU = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, initializer_range=0.08)
# A greedy token agrees with HF when HF's logit for it is within this share of HF's best logit (at least 1): bf16
# keeps 8 significant bits, and two implementations' sums over 22 layers round apart by a few of them.
GREEDY_TOLERANCE = 0.02
GREEDY_GOAL = 0.99
# The GPU-only tests, named so that collection stays narrow (the whole tree imports Ray, gRPC and the e2e stack).
GPU_TEST_FILES = ("tests/kernels/test_kernels_gpu.py", "tests/blocks/test_backend.py")
GPU_TESTS_TIMEOUT_S = 150
TEXT_DRY = dict(TEXT_GPU, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512)


@dataclass(frozen=True)
class Row:
    check: str
    ours: str
    reference: str = ""
    ratio: str = ""
    goal: str = ""
    met: str = ""


@dataclass(frozen=True)
class Sizes:
    device: str
    dtype: torch.dtype
    attn_lens: tuple[int, ...]
    attn_dim: int
    attn_tokens: int  # B x N per call (FlashAttention-2's benchmark setup: 16k tokens, hidden 2048)
    attn_hidden: int  # H x D
    decode: tuple[int, int, int, int, int]  # context, batch, Hq, Hkv, D
    text: dict
    prompt_lens: tuple[int, int]
    concurrent: int
    new_tokens: int
    diffusion_steps: int
    sampler: tuple[int, int]  # rows, vocabulary


GPU = Sizes(device="cuda", dtype=torch.bfloat16, attn_lens=(2048, 4096), attn_dim=128, attn_tokens=16384,
            attn_hidden=2048, decode=(16384, 32, 32, 8, 128), text=TEXT_GPU, prompt_lens=(64, 512), concurrent=64,
            new_tokens=128, diffusion_steps=20, sampler=(64, 128256))
DRY = Sizes(device="cpu", dtype=torch.float32, attn_lens=(64,), attn_dim=16, attn_tokens=64, attn_hidden=32,
            decode=(64, 2, 4, 2, 16), text=TEXT_DRY, prompt_lens=(4, 16), concurrent=3, new_tokens=4,
            diffusion_steps=2, sampler=(3, 512))


def _verdict(value: float, goal: float) -> str:
    return "yes" if value >= goal else "NO"


def timed(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds per call: triton.testing.do_bench on CUDA (L2 flushed between calls), a few wall-clock
    calls on the CPU."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# ---- the GPU-only tests ------------------------------------------------------------------------------------------
def gpu_tests(dry: bool) -> list[Row]:
    """`pytest -m gpu` over GPU_TEST_FILES in a child with compiled kernels (TRITON_INTERPRET=0; the dry run keeps the
    interpreter, where tests/conftest.py skips them) and one autotune candidate per kernel, killed after
    GPU_TESTS_TIMEOUT_S."""
    env = os.environ | {"TRITON_INTERPRET": "1" if dry else "0", "GENSERVE_AUTOTUNE_CONFIGS": "1"}
    command = [sys.executable, "-P", "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *GPU_TEST_FILES]
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=GPU_TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [Row("GPU-only tests (pytest -m gpu)", f"FAILED: timed out after {GPU_TESTS_TIMEOUT_S} s",
                    goal="all pass", met="NO")]
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()[-200:]
    if done.returncode not in (0, 5):
        print(done.stdout[-4000:], done.stderr[-2000:], sep="\n", file=sys.stderr)  # the failures, for the record
    counts = {name: int(n) for n, name in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", summary)}
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    ok = done.returncode in (0, 5) and failed == 0  # 5: nothing collected
    ours = f"{counts.get('passed', 0)} passed, {failed} failed, {counts.get('skipped', 0)} skipped"
    return [Row("GPU-only tests (pytest -m gpu)", ours, goal="all pass", met="yes" if ok else "NO")]


# ---- kernels -----------------------------------------------------------------------------------------------------
def attention_rows(s: Sizes) -> list[Row]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from genserve.kernels import flash_attention

    rows = []
    d = s.attn_dim
    for n in s.attn_lens:
        b, h = max(1, s.attn_tokens // n), s.attn_hidden // d
        q, k, v = (torch.randn(b, h, n, d, device=s.device, dtype=s.dtype) for _ in range(3))
        ours = timed(lambda q=q, k=k, v=v: flash_attention(q, k, v, causal=True), s.device)
        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION] if s.device == "cuda" else [
            SDPBackend.MATH]
        sdpa = []
        for backend in backends:
            with sdpa_kernel([backend]):
                try:
                    sdpa.append(timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                      s.device))
                except RuntimeError:  # a backend that does not take this shape on this GPU
                    pass
        best = min(sdpa)
        flops = 4 * b * h * n * n * d * 0.5
        rows.append(Row(f"flash attention, causal, N={n} D={d}", f"{flops / ours / 1e9:.4g} TFLOP/s",
                        f"SDPA {flops / best / 1e9:.4g} TFLOP/s", f"{best / ours:.3g}x", ">= 1.0x (N >= 2k)",
                        _verdict(best / ours, 1.0)))
    return rows


def copy_bandwidth_gbps(device: str) -> float:
    """(read + write) bytes per second of a large copy on `device`, as the kernel and LM benches measure it."""
    if device == "cuda":
        from bench.gpu_kernels import measure_copy_bandwidth

        return measure_copy_bandwidth()
    from bench.lm import copy_bandwidth_gbs

    return copy_bandwidth_gbs(2**24)


def paged_decode_rows(s: Sizes) -> list[Row]:
    from genserve.kernels import paged_decode_attention

    ctx, batch, hq, hkv, d = s.decode
    block = 16
    per_seq = ctx // block
    k_cache = torch.randn(batch * per_seq, block, hkv, d, device=s.device, dtype=s.dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * per_seq, device=s.device).view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=s.device)
    q = torch.randn(batch, hq, d, device=s.device, dtype=s.dtype)
    ms = timed(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens), s.device)
    gbps = 2 * k_cache.numel() * k_cache.element_size() / ms / 1e6
    copy = copy_bandwidth_gbps(s.device)
    share = gbps / copy
    return [Row(f"paged decode, context {ctx} x batch {batch}", f"{gbps:.4g} GB/s", f"copy {copy:.4g} GB/s",
                f"{100 * share:.3g}%", ">= 70% of copy", _verdict(share, 0.70))]


# ---- sampling --------------------------------------------------------------------------------------------------------
def sampler_rows(s: Sizes) -> list[Row]:
    """The sampler's cost per step where it is largest (issue 37, defect 8): every row nucleus-sampled, which sorts the
    whole vocabulary (Llama 3's on the GPU) and draws by an fp64 inverse CDF, against greedy rows of the same logits
    (one argmax). Compare it with a decode step's time: a share of a few percent leaves the sort as it is."""
    from types import SimpleNamespace

    from genserve.services.text.engine.params import SamplingParams
    from genserve.services.text.engine.sampler import make_generator, sample_batch

    n, vocab = s.sampler
    logits = torch.randn(n, vocab, device=s.device) * 4

    def rows(params: SamplingParams) -> list[SimpleNamespace]:
        return [SimpleNamespace(params=params, generator=make_generator(i), prompt_ids=[], output_ids=[], grammar=None)
                for i in range(n)]

    nucleus, greedy = rows(SamplingParams(temperature=0.8, top_p=0.9)), rows(SamplingParams(temperature=0))
    ours = timed(lambda: sample_batch(logits, nucleus), s.device)
    argmax = timed(lambda: sample_batch(logits, greedy), s.device)
    return [Row(f"sampler, {n} rows x {vocab} vocab, top-p 0.9", f"{ours:.3g} ms/step", f"greedy {argmax:.3g} ms",
                f"{ours / argmax:.3g}x")]


# ---- the text engine against transformers ---------------------------------------------------------------------------
def _prompts(s: Sizes, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(42)
    lens = torch.randint(s.prompt_lens[0], s.prompt_lens[1] + 1, (s.concurrent,), generator=gen).tolist()
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lens]


def engine_greedy(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Tokens/s of the engine over `prompts` submitted at once, greedy, and every request's tokens."""
    from genserve.services.text.engine.params import SamplingParams

    outs: list[list[int]] = [[] for _ in prompts]
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}-{start}", prompt, SamplingParams(max_tokens=new_tokens, temperature=0),
                           lambda delta, i=i: outs[i].extend(delta.token_ids))
    while engine.has_work():
        engine.step()
    return sum(map(len, outs)) / (time.perf_counter() - start), outs


@torch.inference_mode()
def greedy_agreement(hf, prompts: list[list[int]], outs: list[list[int]]) -> tuple[float, float]:
    """(share of the engine's tokens that are HF's argmax, share within GREEDY_TOLERANCE of it), HF scoring each
    token from the engine's own history (teacher forcing), one unpadded sequence at a time."""
    exact = near = total = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt + out[:-1]], device=hf.device)
        logits = hf(ids).logits[0, len(prompt) - 1:].float()  # (len(out), V): what each engine token was picked from
        chosen = logits.gather(1, torch.tensor(out, device=logits.device)[:, None])[:, 0]
        best = logits.max(dim=1).values
        exact += int((chosen == best).sum())
        near += int((chosen >= best - GREEDY_TOLERANCE * best.abs().clamp(min=1.0)).sum())
        total += len(out)
    return exact / total, near / total


def text_rows(s: Sizes) -> list[Row]:
    from bench.lm import NullTokenizer, hf_checkpoint, hf_static_batch
    from genserve.services.text.engine.engine import EngineConfig, LLMEngine
    from genserve.services.text.loader import load_model

    dtype_name = "bfloat16" if s.dtype == torch.bfloat16 else "float32"
    with tempfile.TemporaryDirectory() as directory:
        hf = hf_checkpoint(s.text, Path(directory)).to(device=s.device, dtype=s.dtype)
        # Prefix caching off: the warm-up sends the timed prompt, whose prefill would otherwise be a cache hit.
        engine = LLMEngine(load_model(directory, dtype_name, device=s.device), NullTokenizer(),
                           EngineConfig(max_running=max(64, s.concurrent), max_batched_tokens=4096,
                                        prefix_caching=False))

    prompts = _prompts(s, s.text["vocab_size"])
    rows, tokens = [], []
    for label, batch in (("batch 1", prompts[:1]), (f"{s.concurrent} concurrent", prompts)):
        budgets = [s.new_tokens] * len(batch)
        engine_greedy(engine, batch[:1], s.new_tokens), hf_static_batch(hf, batch[:1], budgets[:1])  # warm-up
        (ours, outs), (theirs, _) = engine_greedy(engine, batch, s.new_tokens), hf_static_batch(hf, batch, budgets)
        tokens.append((batch, outs))
        goal = ">= 2x" if batch is prompts else ""
        rows.append(Row(f"text engine {dtype_name}, {label}, {s.new_tokens} new tokens", f"{ours:.0f} tok/s",
                        f"HF {theirs:.0f} tok/s", f"{ours / theirs:.3g}x", goal,
                        _verdict(ours / theirs, 2.0) if goal else ""))
    checked = [p for batch, _ in tokens for p in batch], [o for _, outs in tokens for o in outs]
    exact, near = greedy_agreement(hf, *checked)
    rows.append(Row(f"greedy tokens vs HF (teacher-forced), {sum(map(len, checked[1]))} tokens",
                    f"{100 * exact:.4g}% HF's argmax", f"within {GREEDY_TOLERANCE:.0%} of HF's best",
                    f"{100 * near:.4g}%", f">= {GREEDY_GOAL:.0%} within", _verdict(near, GREEDY_GOAL)))
    return rows


# ---- diffusion ------------------------------------------------------------------------------------------------------
def diffusion_rows(s: Sizes) -> list[Row]:
    from bench.diffusion import diffusers_twin, image_diffusers, image_ours, time_interleaved
    from genserve.services.diffusion.model import load_diffusion
    from genserve.services.diffusion.pipeline import DiffusionPipeline

    model = load_diffusion(None)
    pipe = DiffusionPipeline(model, device=s.device)
    twin = diffusers_twin(model).to(s.device)
    ours, theirs = time_interleaved(image_ours(pipe, s.diffusion_steps, 3.0),
                                    image_diffusers(twin, pipe, s.diffusion_steps, 3.0), repeats=3)
    ratio = statistics.median(theirs) / statistics.median(ours)
    return [Row(f"diffusion, {s.diffusion_steps} DDIM steps + guidance, demo U-Net",
                f"{statistics.median(ours) * 1e3:.0f} ms/image", f"diffusers {statistics.median(theirs) * 1e3:.0f} ms",
                f"{ratio:.3g}x")]


def render(rows: list[Row], header: str) -> str:
    lines = [header, "", "| check | genserve | reference | ratio | goal | met |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.check} | {r.ours} | {r.reference} | {r.ratio} | {r.goal} | {r.met} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="tiny sizes on the CPU: checks the script, measures nothing")
    parser.add_argument("--skip-tests", action="store_true", help="leave out the pytest -m gpu row")
    parser.add_argument("--device-run", action="store_true",
                        help="run from the checkout, uninstalled, on the GPU check machine's own python and torch")
    args = parser.parse_args(argv)
    if args.device_run:
        from bench.checkout import link_checkout

        link_checkout(Path(tempfile.mkdtemp(prefix="genserve-checkout-")))
    if not args.dry and not torch.cuda.is_available():
        print("gpu-check needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); "
              "`--dry` runs it on the CPU at tiny sizes.")
        return 1
    sizes = DRY if args.dry else GPU
    torch.manual_seed(0)
    started = time.perf_counter()
    rows = [] if args.skip_tests else gpu_tests(args.dry)
    for section in (attention_rows, paged_decode_rows, sampler_rows, text_rows, diffusion_rows):
        try:
            rows += section(sizes)
        except Exception as exc:  # one broken section must not hide the others' figures
            rows.append(Row(section.__name__, f"FAILED: {type(exc).__name__}: {str(exc)[:160]}", met="NO"))
        if sizes.device == "cuda":
            torch.cuda.empty_cache()
    if args.dry:  # tiny CPU figures meet or miss nothing; only a section that failed to run counts
        rows = [r if r.ours.startswith("FAILED") else Row(r.check, r.ours, r.reference, r.ratio, r.goal, "dry")
                for r in rows]
    device = torch.cuda.get_device_name(0) if sizes.device == "cuda" else "CPU (dry run: the figures mean nothing)"
    import triton

    header = (f"gpu-check {datetime.date.today().isoformat()} on {device}, Python {sys.version.split()[0]}, "
              f"torch {torch.__version__}, Triton {triton.__version__}, {time.perf_counter() - started:.0f} s")
    print(render(rows, header))
    return 0 if all(r.met != "NO" for r in rows) else 1


if __name__ == "__main__":
    if "--dry" in sys.argv[1:]:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so before importing them
    sys.exit(main())
