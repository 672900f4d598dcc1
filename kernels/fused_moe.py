"""Mixture-of-experts FFN as two grouped GEMMs (Remark 18, "Mixture-of-Experts", of the chapter "Deep Learning
Building Blocks"; the layout of vLLM's fused_moe and llama.cpp's mul_mat_id).

Every (token, slot) pair that routing produced is sorted by expert, and each expert's run of pairs is padded to a
whole number of BLOCK_M rows, so that every row tile belongs to one expert (`align`). Then:
1. `_gate_up_kernel`: per tile, the tile's token rows times that expert's stacked [W_gate; W_up] (E, 2I, H), both
   halves in one pass over K, and SiLU(gate) * up written to an intermediate (padded pairs, I);
2. `_down_kernel`: the intermediate rows times that expert's W_down (E, H, I), each row scaled by its routing weight
   and written at its (token, slot) position; a sum over the k slots gives each token's output.
Padding rows point past the last pair and are neither loaded nor stored. No loop over tokens or experts runs on the
host: the tiles of all experts go out in one launch per GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from genserve.kernels._runtime import dot_precision, upcast_for_interpreter

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32  # decode-sized row tiles: a step routes a few rows to each expert


def align(topk_ids: torch.Tensor, n_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids (N, k) -> (pair index per padded row (R,), expert per row tile (R / block_m,)); a padding row holds
    N k, one past the last pair.

    R is a bound known from the shapes alone, not the padded total: reading that total back would stop the host once
    per MoE layer per step (and rule out a CUDA graph). So no op here needs a value on the host (torch.bincount and
    repeat_interleave would read one); the tiles past the experts' own are padding alone, and the kernels leave them
    at their first row."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    # sum over experts of ceil(count / block_m) <= pairs / block_m + (experts with a pair)
    max_tiles = pairs // block_m + min(n_experts, pairs)
    order = flat.argsort(stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded  # each expert's first padded row
    rows = torch.full((max_tiles * block_m,), pairs, dtype=torch.int64, device=flat.device)
    rank = torch.arange(pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    rows[starts[flat[order]] + rank] = order
    # tile t belongs to the expert whose tiles end first after it; the padding tiles past the last get the last expert
    tiles = torch.arange(max_tiles, device=flat.device)
    experts = torch.searchsorted(ends // block_m, tiles, right=True).clamp_(max=n_experts - 1)
    return rows, experts


@triton.jit
def _gate_up_kernel(
    X, W, Out, rows_ptr, experts_ptr,
    n_pairs, top_k, hidden, inter,
    stride_xm, stride_we, stride_wn, stride_om,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if tl.load(rows_ptr + pid_m * BLOCK_M) >= n_pairs:  # a tile of padding alone (align): no expert's rows
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(rows_ptr + offs_m)
    row_ok = pairs < n_pairs
    tokens = pairs // top_k
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < inter
    w_gate = W + expert * stride_we + offs_n[None, :] * stride_wn
    w_up = w_gate + inter * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        x = tl.load(X + tokens[:, None] * stride_xm + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        g = tl.load(w_gate + offs_k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        u = tl.load(w_up + offs_k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            x, g, u = x.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(x, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(x, u, acc_u, input_precision=DOT_PRECISION)
    act = acc_g * tl.sigmoid(acc_g) * acc_u  # SiLU(gate) * up
    tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], act.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    A, W, Out, rows_ptr, experts_ptr, weights_ptr,
    n_pairs, hidden, inter,
    stride_am, stride_we, stride_wn, stride_om,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if tl.load(rows_ptr + pid_m * BLOCK_M) >= n_pairs:  # a tile of padding alone (align): no expert's rows
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(rows_ptr + offs_m)
    row_ok = pairs < n_pairs
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < hidden
    w = W + expert * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter
        a = tl.load(A + offs_m[:, None] * stride_am + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w + offs_k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    scale = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Out + pairs[:, None] * stride_om + offs_n[None, :], (acc * scale[:, None]).to(Out.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_j w_tj SwiGLU_{e_tj}(x_t) for x (N, H), experts' stacked [W_gate; W_up] (E, 2I, H) and W_down (E, H, I)
    as nn.Linear stores them, routing weights and expert ids (N, k) -> (N, H) (module docstring)."""
    n, hidden = x.shape
    n_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    if w_gate_up.shape != (n_experts, 2 * inter, hidden) or w_down.shape != (n_experts, hidden, inter):
        raise ValueError(f"expected w_gate_up (E, 2I, {hidden}) and w_down (E, {hidden}, I); got "
                         f"{tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != n:
        raise ValueError(f"topk_ids and topk_weights must both be (N={n}, k); got {tuple(topk_ids.shape)}, "
                         f"{tuple(topk_weights.shape)}")
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    top_k = topk_ids.shape[1]
    rows, experts = align(topk_ids, n_experts)
    pairs = n * top_k
    meta = dict(UPCAST=upcast_for_interpreter(x.dtype), DOT_PRECISION=dot_precision(x.dtype), BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    act = x.new_empty((rows.numel(), inter))
    _gate_up_kernel[(experts.numel(), triton.cdiv(inter, BLOCK_N))](
        x, w_gate_up, act, rows, experts, pairs, top_k, hidden, inter,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0), **meta)
    out = x.new_empty((pairs, hidden))
    _down_kernel[(experts.numel(), triton.cdiv(hidden, BLOCK_N))](
        act, w_down, out, rows, experts, topk_weights.reshape(-1).float().contiguous(), pairs, hidden, inter,
        act.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0), **meta)
    return out.view(n, top_k, hidden).sum(1)
