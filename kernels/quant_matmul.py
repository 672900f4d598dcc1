"""y = x W^T + b with W in GGUF's quantised blocks (Q8_0, Q4_0, Q4_1; layouts in kernels/quant_formats.py),
dequantised tile by tile inside the matmul: the weight crosses memory as the file's bytes and lives in fp32/fp16 only
in registers.

Each program computes a (BLOCK_M, BLOCK_N) tile of y. Per BLOCK_K step it gathers, for each of its BLOCK_N weight
rows, the bytes of BLOCK_K / 32 blocks: the fp16 scale (and Q4_1's minimum) once per block, from two bytes (blocks
are 18, 20 or 34 bytes long, so a scale may sit at an odd address), and each weight's quant (Q4: the low nibble of
byte t for t < 16, the high nibble of byte t - 16 otherwise). The dequantised tile goes into ``tl.dot`` in x's
dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from genserve.kernels._runtime import dot_precision, upcast_for_interpreter
from genserve.kernels.quant_formats import BLOCK, FORMATS, quant_format, row_bytes

__all__ = ["FORMATS", "quant_linear"]


@triton.jit
def _half(ptr, mask):
    """The little-endian fp16 at byte pointers ``ptr`` (any alignment), as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _per_weight(v, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_N, BLOCK_K / 32) per-block values -> (BLOCK_N, BLOCK_K), each repeated over its block's 32 weights."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)), (BLOCK_N, BLOCK_K))


@triton.jit
def _quant_matmul_kernel(
    X, W, B, Y,
    M, N, K, stride_xm, stride_ym, row_bytes,
    QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    rows = W + offs_n.to(tl.int64)[:, None] * row_bytes  # (BLOCK_N, 1) byte pointers to each weight row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # (BLOCK_M, BLOCK_K)
        # -- the BLOCK_K / 32 blocks under this K step: scale and minimum once per (row, block) --
        offs_b = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        heads = rows + offs_b[None, :] * BLOCK_BYTES  # (BLOCK_N, BLOCK_K / 32) pointers to block starts
        ok_b = n_ok[:, None] & (offs_b < K // 32)[None, :]
        d = _per_weight(_half(heads, ok_b), BLOCK_N, BLOCK_K)  # (BLOCK_N, BLOCK_K)
        # -- each weight's quant: byte t of the block (Q8_0), or a nibble of byte t % 16 (Q4) --
        block = rows + (offs_k // 32)[None, :] * BLOCK_BYTES  # (BLOCK_N, BLOCK_K)
        t = (offs_k % 32)[None, :]
        ok = n_ok[:, None] & k_ok[None, :]
        if QTYPE == 8:
            q = tl.load(block + 2 + t, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            w = d * q
        else:
            qs = tl.load(block + (4 if QTYPE == 3 else 2) + t % 16, mask=ok, other=0)
            q = tl.where(t < 16, qs & 15, qs >> 4).to(tl.float32)
            m = _per_weight(_half(heads + 2, ok_b), BLOCK_N, BLOCK_K) if QTYPE == 3 else -8.0 * d
            w = d * q + m  # (BLOCK_N, BLOCK_K)
        # -- accumulate x W^T --
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def quant_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: str | int, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x (..., K) fp32/fp16/bf16, blocks uint8 (N, K / 32 * block bytes) of ``qtype``, bias (N,) -> (..., N) in
    x's dtype. Forward only."""
    fmt, k, n = quant_format(qtype), x.shape[-1], blocks.shape[0]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(fmt, k) or \
            (bias is not None and bias.shape != (n,)):
        raise ValueError(f"quant_linear: x (..., {k}), {fmt.name} blocks {blocks.dtype} {tuple(blocks.shape)} and "
                         f"bias {None if bias is None else tuple(bias.shape)} do not fit y = x W^T + b")
    x2, blocks = x.reshape(-1, k).contiguous(), blocks.contiguous()  # (M, K)
    y = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)  # (M, N)
    if x2.shape[0] and n:
        block_m = 16 if x2.shape[0] <= 16 else 64  # tl.dot's smallest M; decode batches fill one tile
        grid = (triton.cdiv(x2.shape[0], block_m), triton.cdiv(n, 64))
        _quant_matmul_kernel[grid](
            x2, blocks, bias if bias is not None else x2, y,
            x2.shape[0], n, k, x2.stride(0), y.stride(0), blocks.stride(0),
            QTYPE=fmt.ggml_type, BLOCK_BYTES=fmt.block_bytes, HAS_BIAS=bias is not None,
            UPCAST=upcast_for_interpreter(x.dtype), DOT_PRECISION=dot_precision(x.dtype),
            BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=2 * BLOCK,
        )
    return y.reshape(*x.shape[:-1], n)
