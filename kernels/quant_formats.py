"""GGUF's weight-only quantised block formats (llama.cpp's ggml-common.h), kept as the file's raw bytes.

A weight matrix (N, K) is N rows of K / 32 blocks; each block holds 32 weights as one fp16 scale ``d`` (Q4_1 also an
fp16 minimum ``m``) followed by the quants, little-endian:

    Q8_0  34 bytes: d, int8 q[32]         w[t] = d * q[t]
    Q4_0  18 bytes: d, uint8 qs[16]       w[t] = d * ((qs[t] & 15) - 8),   w[t + 16] = d * ((qs[t] >> 4) - 8)
    Q4_1  20 bytes: d, m, uint8 qs[16]    w[t] = d * (qs[t] & 15) + m,     w[t + 16] = d * (qs[t] >> 4) + m

(low nibbles are the block's first 16 weights, high nibbles its last 16). ``dequantize`` is that table in torch ops:
the reference every kernel is checked against, and the path of devices without a kernel. The type ids are GGML's
(``gguf.GGMLQuantizationType``), which the kernels take unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block, in every format here


@dataclass(frozen=True)
class QuantFormat:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value
    block_bytes: int


FORMATS = {f.name: f for f in (QuantFormat("Q4_0", 2, 18), QuantFormat("Q4_1", 3, 20), QuantFormat("Q8_0", 8, 34))}
_BY_ID = {f.ggml_type: f for f in FORMATS.values()}


def quant_format(qtype: str | int) -> QuantFormat:
    """The format called ``qtype`` (a name such as "Q4_1", or a GGML type id / ``GGMLQuantizationType``);
    ValueError naming it when it is not one of Q8_0, Q4_0, Q4_1."""
    fmt = _BY_ID.get(int(qtype)) if not isinstance(qtype, str) else FORMATS.get(qtype.upper())
    if fmt is None:
        name = getattr(qtype, "name", qtype)
        raise ValueError(f"quantized type {name!r} is not kept quantized; expected one of {sorted(FORMATS)}")
    return fmt


def row_bytes(fmt: QuantFormat, in_features: int) -> int:
    """Bytes of one weight row of ``in_features`` values; ValueError unless it is a whole number of blocks."""
    if in_features <= 0 or in_features % BLOCK:
        raise ValueError(f"{fmt.name} rows hold whole blocks of {BLOCK} weights; got in_features={in_features}")
    return in_features // BLOCK * fmt.block_bytes


def _halves(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) bytes -> (...,) fp32 of the little-endian fp16 they spell (copied first: blocks of 18 or 34 bytes
    put every other scale at an odd address)."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def dequantize(blocks: torch.Tensor, qtype: str | int, in_features: int) -> torch.Tensor:
    """blocks uint8 (N, row_bytes) -> fp32 weights (N, in_features), exactly as gguf.quants.dequantize."""
    fmt = quant_format(qtype)
    n = blocks.shape[0]
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != row_bytes(fmt, in_features):
        raise ValueError(f"{fmt.name} blocks for {in_features} inputs must be uint8 (N, "
                         f"{row_bytes(fmt, in_features)}); got {blocks.dtype} {tuple(blocks.shape)}")
    b = blocks.reshape(n, in_features // BLOCK, fmt.block_bytes)  # (N, K/32, bytes)
    d = _halves(b[..., 0:2])[..., None]  # (N, K/32, 1)
    if fmt.name == "Q8_0":
        q = b[..., 2:].view(torch.int8).float()  # (N, K/32, 32)
        return (d * q).reshape(n, in_features)
    qs = b[..., 4:] if fmt.name == "Q4_1" else b[..., 2:]  # (N, K/32, 16)
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # (N, K/32, 32): low nibbles first
    m = _halves(b[..., 2:4])[..., None] if fmt.name == "Q4_1" else -8.0 * d
    return (d * q + m).reshape(n, in_features)
