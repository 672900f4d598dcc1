"""Multi-LoRA as two Triton kernels, Punica's BGMV (Chen et al. 2023) and vLLM's lora_shrink / lora_expand: every
token of a batch gets the delta of its own adapter slot in the same launch,

    shrink:  t_i = x_i A_{s_i}^T            (N, in) -> (N, R)
    expand:  y_i += t_i B_{s_i}^T           (N, R) -> (N, out), in place

with A stacked (slots, R, in), B (slots, out, R) (the scale already folded into B, shared/blocks/lora.py), ``slots``
(N,) int32 with -1 for a token of the base model (its t is 0 and its y untouched) and ``ranks`` (slots,) int32, each
slot's rank (columns past it are masked, so the padding of a smaller adapter is never read). One program per block
of tokens (and of outputs, for expand): each token reads its slot from ``slots``, so the grid does not depend on
which adapters a step holds and a CUDA graph can replay it with new slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per program: each row still reads its own slot's A and B (gathered per row), and a block of rows shares the
# loads of x's and y's tiles; 16 rows keep a (16, R, 32) tile of A and a (16, 64, R) one of B in registers for ranks
# up to 16.
BLOCK_M = 16


@triton.jit
def _shrink_kernel(X, A, SLOTS, RANKS, T, n_rows, n_in, stride_x, stride_as, stride_ar, stride_t,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    slot = tl.load(SLOTS + rows, mask=row_ok, other=-1)
    # a base-model token (slot -1) or a row past the batch gets rank 0: every column masked, its t stays 0
    rank = tl.where(slot >= 0, tl.load(RANKS + tl.maximum(slot, 0), mask=row_ok, other=0), 0)
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs[None, :] < rank[:, None]  # (M, R)
    a_rows = A + tl.maximum(slot, 0).to(tl.int64)[:, None, None] * stride_as + rs[None, :, None] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    # -- t[m, r] = sum_k A[slot_m, r, k] x[m, k], over blocks of the input features --
    for k0 in range(0, n_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < n_in
        x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # (M, K)
        a = tl.load(a_rows + ks[None, None, :], mask=r_ok[:, :, None] & k_ok[None, None, :],
                    other=0.0).to(tl.float32)  # (M, R, K): each row's own adapter
        acc += tl.sum(a * x[:, None, :], 2)
    tl.store(T + rows.to(tl.int64)[:, None] * stride_t + rs[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _expand_kernel(T, B, SLOTS, RANKS, Y, n_rows, n_out, stride_t, stride_bs, stride_bo, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(SLOTS + rows, mask=rows < n_rows, other=-1)
    rank = tl.where(slot >= 0, tl.load(RANKS + tl.maximum(slot, 0), mask=rows < n_rows, other=0), 0)
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs[None, :] < rank[:, None]  # (M, R)
    # a base-model token or a row past the batch writes nothing
    y_ok = (ns[None, :] < n_out) & (rank[:, None] > 0)  # (M, N)
    # -- y[m, n] += sum_r B[slot_m, n, r] t[m, r] --
    t = tl.load(T + rows.to(tl.int64)[:, None] * stride_t + rs[None, :], mask=r_ok, other=0.0)  # (M, R)
    b = tl.load(B + tl.maximum(slot, 0).to(tl.int64)[:, None, None] * stride_bs + ns[None, :, None] * stride_bo
                + rs[None, None, :], mask=y_ok[:, :, None] & r_ok[:, None, :], other=0.0).to(tl.float32)  # (M, N, R)
    y_ptrs = Y + rows.to(tl.int64)[:, None] * stride_y + ns[None, :]
    y = tl.load(y_ptrs, mask=y_ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + tl.sum(b * t[:, None, :], 2)).to(Y.dtype.element_ty), mask=y_ok)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """x (N, in), a (slots, R, in) -> t (N, R) fp32, row i = x_i A_{slots[i]}^T (0 where slots[i] < 0)."""
    n, n_in = x.shape
    max_rank = a.shape[1]
    assert a.shape[2] == n_in and a.stride(2) == 1 and x.stride(1) == 1, "x and A must share a unit-stride in_features"
    block_r = triton.next_power_of_2(max_rank)
    t = torch.empty(n, block_r, dtype=torch.float32, device=x.device)
    if n:
        _shrink_kernel[(triton.cdiv(n, BLOCK_M),)](
            x, a, slots, ranks, t, n, n_in, x.stride(0), a.stride(0), a.stride(1), t.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=min(32, triton.next_power_of_2(n_in)))
    return t


def lora_expand(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor
                ) -> torch.Tensor:
    """y (N, out) += t_i B_{slots[i]}^T in place for t (N, >= R) from ``lora_shrink``, b (slots, out, R); returns y."""
    n, n_out = y.shape
    assert b.shape[1] == n_out and b.stride(2) == 1 and y.stride(1) == 1, "y and B must share out_features"
    block_n = min(64, triton.next_power_of_2(n_out))
    if n:
        _expand_kernel[(triton.cdiv(n, BLOCK_M), triton.cdiv(n_out, block_n))](
            t, b, slots, ranks, y, n, n_out, t.stride(0), b.stride(0), b.stride(1), y.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_R=t.shape[1], BLOCK_N=block_n)
    return y


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
             ranks: torch.Tensor) -> torch.Tensor:
    """y (N, out) += (x_i A_s^T) B_s^T with s = slots[i] for every token i with an adapter, in place; returns y."""
    return lora_expand(y, lora_shrink(x, a, slots, ranks), b, slots, ranks)
