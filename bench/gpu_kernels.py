"""Kernel benchmark: Triton kernels vs torch on one CUDA GPU, printed (and optionally written) as markdown tables.

    python -m bench.gpu_kernels [--out docs/kernel-bench.md] [--quick]

- flash_attention: TFLOP/s, bf16, N in {512 .. 16k}, D in {64, 128}, causal and not, vs torch SDPA's flash and
  cuDNN backends (ratio to the faster of the two). 16k tokens per batch, Hq = Hkv = 2048 / D (FlashAttention-2's
  benchmark setup); FLOPs = 4 N^2 D per head (halved when causal).
- paged_decode_attention: GB/s of K/V read, context 1k..64k x batch 1..64, Llama-3-8B heads (32 q / 8 kv, D=128),
  16-token blocks in shuffled order, as % of a measured device-to-device copy bandwidth (read + write bytes), and
  the ratio to torch SDPA decoding from a contiguous (unpaged) cache of the same length.
- rms_norm (with the residual add) and apply_rope: GB/s vs the eager torch the torch backend runs.
On a machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    # Run as a file: `bench` imports from the repository root, appended so that it never shadows an installed package.
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ATTN_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
ATTN_HEAD_DIMS = (64, 128)
ATTN_TOKENS = 16384
ATTN_HIDDEN = 2048
DECODE_CONTEXTS = (1024, 4096, 16384, 65536)
DECODE_BATCHES = (1, 8, 32, 64)
DECODE_HEADS = (32, 8, 128)  # Hq, Hkv, D
DECODE_BLOCK = 16
# Skip decode points whose cache (paged + the contiguous baseline copy) would not fit comfortably.
DECODE_MAX_BYTES = 48 * 2**30
NORM_SHAPES = ((4096, 4096), (16384, 8192))
ROPE_TOKENS = (4096, 32768)


def _bench(fn: Callable[[], object]) -> float:
    """Median milliseconds per call, with L2 flushed between calls (triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _try_bench(fn: Callable[[], object]) -> float | None:
    try:
        return _bench(fn)
    except RuntimeError:  # e.g. an SDPA backend that does not support this shape on this GPU
        return None


def _fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _table(title: str, header: list[str], rows: list[list[str]]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _attention_point(n: int, d: int, causal: bool) -> list[str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from genserve.kernels import flash_attention

    b, h = max(1, ATTN_TOKENS // n), ATTN_HIDDEN // d
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    ours = _bench(lambda: flash_attention(q, k, v, causal=causal))
    sdpa = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel([backend]):
            sdpa[name] = _try_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    best = min((t for t in sdpa.values() if t is not None), default=None)

    def tflops(ms: float | None) -> str:
        return _fmt(None if ms is None else flops / ms / 1e9)

    return [
        str(n), str(d), "yes" if causal else "no", f"{b}x{h}",
        tflops(ours), tflops(sdpa["flash"]), tflops(sdpa["cudnn"]), _fmt(None if best is None else best / ours, 2),
    ]


def bench_attention(quick: bool) -> str:
    rows = [
        _attention_point(n, d, causal)
        for d in ATTN_HEAD_DIMS
        for causal in (False, True)
        for n in (ATTN_SEQ_LENS[2::2] if quick else ATTN_SEQ_LENS)
    ]
    header = ["N", "D", "causal", "BxH", "triton TFLOP/s", "SDPA flash", "SDPA cuDNN", "triton / best SDPA"]
    return _table("flash_attention forward, bf16", header, rows)


def measure_copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB: (read + write) bytes / time, in GB/s."""
    src = torch.empty(2**30, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def _time_paged_decode(ctx: int, batch: int, q: torch.Tensor) -> float:
    from genserve.kernels import paged_decode_attention

    _, hkv, d = DECODE_HEADS
    blocks_per_seq = ctx // DECODE_BLOCK
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, DECODE_BLOCK, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return _bench(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens))


def _time_contiguous_sdpa_decode(ctx: int, batch: int, q: torch.Tensor) -> float | None:
    _, hkv, d = DECODE_HEADS
    k, v = (torch.randn(batch, hkv, ctx, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return _try_bench(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True))


def _decode_point(ctx: int, batch: int, copy_gbps: float) -> list[str]:
    hq, hkv, d = DECODE_HEADS
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    ours = _time_paged_decode(ctx, batch, q)
    base = _time_contiguous_sdpa_decode(ctx, batch, q)
    gbps = 2 * batch * ctx * hkv * d * 2 / ours / 1e6
    return [
        str(ctx), str(batch), f"{ours * 1e3:.0f}", _fmt(gbps, 0), _fmt(100 * gbps / copy_gbps, 0),
        _fmt(None if base is None else base / ours, 2),
    ]


def bench_decode(quick: bool, copy_gbps: float) -> str:
    hq, hkv, d = DECODE_HEADS
    rows = []
    for ctx in DECODE_CONTEXTS[1::2] if quick else DECODE_CONTEXTS:
        for batch in DECODE_BATCHES[::3] if quick else DECODE_BATCHES:
            # the paged cache plus the contiguous copy for the SDPA baseline
            if 2 * (2 * batch * ctx * hkv * d * 2) <= DECODE_MAX_BYTES:
                rows.append(_decode_point(ctx, batch, copy_gbps))
                torch.cuda.empty_cache()
    header = ["context", "batch", "triton us", "GB/s (K+V read)", "% of copy BW", "SDPA (contiguous) / triton"]
    title = f"paged_decode_attention, bf16, Hq={hq} Hkv={hkv} D={d}, {DECODE_BLOCK}-token blocks"
    return _table(title, header, rows)


def bench_elementwise(quick: bool) -> str:
    from genserve.kernels import apply_rope, rms_norm
    from genserve.shared.blocks.backend import get_backend
    from genserve.shared.blocks.rope import rope_cos_sin

    torch_backend = get_backend("torch")
    rows = []
    for tokens, hidden in NORM_SHAPES[:1] if quick else NORM_SHAPES:
        x, r = (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        moved = 4 * x.numel() * x.element_size()  # read x, residual; write y, new residual
        ours = _bench(lambda x=x, r=r, w=w: rms_norm(x, w, 1e-5, residual=r))
        eager = _bench(lambda x=x, r=r, w=w: torch_backend.rms_norm(x, w, 1e-5, r))
        rows.append([f"rms_norm + residual {tokens}x{hidden}", _fmt(moved / ours / 1e6, 0),
                     _fmt(moved / eager / 1e6, 0), _fmt(eager / ours, 2)])
    cos, sin = (t.cuda() for t in rope_cos_sin(128, 65536))
    for tokens in ROPE_TOKENS[:1] if quick else ROPE_TOKENS:
        q = torch.randn(1, tokens, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(1, tokens, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        positions = torch.arange(tokens, device="cuda")
        moved = 2 * (q.numel() + k.numel()) * q.element_size()  # read and write q, k (tables stay in L2)
        ours = _bench(lambda q=q, k=k, p=positions: apply_rope(q, k, cos, sin, p))
        eager = _bench(lambda q=q, k=k, p=positions: torch_backend.apply_rope(q, k, cos, sin, p))
        rows.append([f"apply_rope {tokens} tok, 32+8 heads", _fmt(moved / ours / 1e6, 0),
                     _fmt(moved / eager / 1e6, 0), _fmt(eager / ours, 2)])
    return _table("rms_norm / apply_rope, bf16", ["op", "triton GB/s", "eager torch GB/s", "speed-up"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the tables to this markdown file")
    parser.add_argument("--quick", action="store_true", help="a subset of the sizes (about a minute)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_kernels.py needs a CUDA GPU and none is visible here (torch.cuda.is_available() is False); "
              "nothing was measured.")
        return 0

    torch.manual_seed(0)
    start = time.time()
    props = torch.cuda.get_device_properties(0)
    copy_gbps = measure_copy_bandwidth()
    import triton

    head = (
        f"## Kernel benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
        f"GPU: {props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB); "
        f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}. "
        f"Measured copy bandwidth: {copy_gbps:.0f} GB/s.\n"
    )
    print(head, flush=True)
    sections = [head]
    for section in (bench_attention(args.quick), bench_decode(args.quick, copy_gbps), bench_elementwise(args.quick)):
        print(section, flush=True)
        sections.append(section)
    footer = f"_{math.ceil(time.time() - start)} s; `python -m bench.gpu_kernels{' --quick' if args.quick else ''}`._\n"
    print(footer)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join([*sections, footer]))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
