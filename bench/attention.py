"""Bidirectional CPU attention for small heads: kernels/cpu_attention.py (csrc/attention.c) against torch's SDPA on the
same tensors (issue 36).

    .venv/bin/python -P bench/attention.py [--threads 2] [--repeats 10]

The shapes are a diffusion transformer's: the SD3-shaped DiT of ``bench/diffusion.py --dit`` at 512^2 (a batch of 2
for CFG, 4 heads of 16, 1,024 image + 333 text tokens), the same width as 2 heads of 32, and a 64-wide head, which
the kernel leaves to SDPA (kernels/cpu_attention.HEAD_SIZES). Calls alternate between the two sides; the table has
the best call of each, its GFLOP/s (4 B H T^2 D flops: two products; the exps are not counted) and the ratio, beside
the fp32 roofline of the cores given on the command line (``--peak``, GFLOP/s).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from genserve.kernels import cpu_attention

SHAPES = ((2, 4, 1357, 16), (2, 2, 1357, 32), (2, 1, 1357, 64))  # (B, H, T, D)


def best_calls(fns: list, tensors: tuple[torch.Tensor, ...], repeats: int) -> list[float]:
    """The best time of each of ``fns`` called on ``tensors``, the calls alternating between them."""
    times = [[] for _ in fns]
    for fn in fns:
        fn(*tensors)
    for _ in range(repeats):
        for fn, spent in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn(*tensors)
            spent.append(time.perf_counter() - start)
    return [min(spent) for spent in times]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--peak", type=float, default=157.0,
                        help="the cores' fp32 FMA roofline in GFLOP/s (2 cores x 2 FMA x 8 lanes x 2 x 2.45 GHz)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.threads} threads, best of {args.repeats} alternating calls; roofline {args.peak:.0f} GFLOP/s")
    print("| B, H, T, D | torch SDPA ms (GFLOP/s) | genserve ms (GFLOP/s) | speed-up | genserve / roofline |")
    print("|---|---|---|---|---|")
    for b, h, t, d in SHAPES:
        # (B, T, H, D) storage seen as (B, H, T, D): what a projection's output reshaped into heads is
        qkv = tuple(torch.randn(b, t, h, d, generator=gen).transpose(1, 2) for _ in range(3))
        flops = 4 * b * h * t * t * d
        if cpu_attention.supports(*qkv):
            torch_s, ours_s = best_calls([F.scaled_dot_product_attention, cpu_attention.attention], qkv, args.repeats)
            ours = f"{ours_s * 1e3:.1f} ({flops / ours_s / 1e9:.0f})"
            ratio, share = f"{torch_s / ours_s:.2f}x", f"{flops / ours_s / 1e9 / args.peak:.0%}"
        else:
            (torch_s,) = best_calls([F.scaled_dot_product_attention], qkv, args.repeats)
            ours, ratio, share = "SDPA (D > 32)", "1.00x", "-"
        print(f"| {b}, {h}, {t}, {d} | {torch_s * 1e3:.1f} ({flops / torch_s / 1e9:.0f}) | {ours} | {ratio} | "
              f"{share} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
