"""RMSNorm (Definition 19, "Root Mean Square Layer Normalisation", of the chapter "Deep Learning Building Blocks") with
the residual add fused in: one read of x (and the residual), one write of y.

    RMSNorm(x) = x / sqrt(mean(x^2) + eps) * gamma

With a residual, new_residual = x + residual is written once and normalised from registers, so the pre-norm block
pattern `h = h + sublayer(...); y = norm(h)` costs one pass instead of three. The rounding follows the backend
contract's reference exactly: the sum is rounded to the input dtype before the norm, the normalised value is
rounded to the input dtype before the weight multiplies it, and the output dtype is that of `weight * x`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One row per program: the whole row lives in registers, so the widest supported row is this many elements.
MAX_BLOCK = 65536


@triton.jit
def _rms_norm_kernel(
    X, R, W, Y, R_OUT,
    stride_x, stride_r, stride_y, stride_ro,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=col_ok, other=0.0)
    # -- the fused residual add, rounded to the activation dtype as the unfused pair would be --
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=col_ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(R_OUT.dtype.element_ty)
        tl.store(R_OUT + row * stride_ro + cols, x, mask=col_ok)
    # -- RMS(x) = sqrt(mean(x^2)) in fp32 over the real columns (padding loads as 0 and adds nothing) --
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    normed = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
    # -- scale by gamma --
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (normed * w).to(Y.dtype.element_ty), mask=col_ok)


def _num_warps(block: int) -> int:
    # ~8 elements per thread keeps loads 16-byte wide without spilling for wide rows.
    return max(1, min(16, block // 256))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A (rows, n_cols) view with a unit column stride (a copy only if the input is not already one)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) * weight over the last dim; with `residual`, (RMSNorm(h) * weight, h) where h = x + residual.

    x (..., H), weight (H,), residual like x. Inputs are not modified.
    """
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"weight must be ({n_cols},); got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x; got {tuple(residual.shape)} {residual.dtype} vs "
                         f"{tuple(x.shape)} {x.dtype}")
    block = triton.next_power_of_2(n_cols)
    if block > MAX_BLOCK:
        raise ValueError(f"rows wider than {MAX_BLOCK} are not supported; got {n_cols}")

    x2, weight = _rows(x), weight.contiguous()
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    y2 = y.view(-1, n_cols)
    has_residual = residual is not None
    if has_residual:
        r2 = _rows(residual)
        new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
        ro2 = new_residual.view(-1, n_cols)
    else:
        # Never read or written when HAS_RESIDUAL is false; x keeps the signature fixed.
        r2, ro2 = x2, x2
    n_rows = x2.shape[0]
    if n_rows > 0:
        _rms_norm_kernel[(n_rows,)](
            x2, r2, weight, y2, ro2,
            x2.stride(0), r2.stride(0), y2.stride(0), ro2.stride(0),
            n_cols, eps,
            HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=_num_warps(block),
        )
    return (y, new_residual) if has_residual else y
