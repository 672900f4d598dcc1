"""A diffusion U-Net's spatial transformer (GroupNorm, proj_in, self-attention, cross-attention to the text, GELU
feedforward, proj_out, residual) for fp32 CPU inference in one call (csrc/spatial_transformer.c).

At latent size (2 x 8 x 8 or 2 x 4 x 4 tokens of 64-128 channels) each of a block's ~40 tensor ops costs a few
microseconds of dispatch around a few microseconds of arithmetic. The C kernel runs the block's products on the
``sgemm_`` (Fortran BLAS, LP64) that torch's CPU library exports, which on x86 builds is MKL, the same routine
behind torch's own addmm; where this torch exports none, ``available()`` is False and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from genserve.kernels._cpu_library import library

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_INT_MAX = 2**31 - 1  # sgemm's LP64 sizes and strides


class _BlockWeights(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("gn_w", "gn_b", "w_in", "b_in", "ln1_w", "ln1_b", "w_qkv", "b_qkv", "w_o1", "b_o1",
                                  "ln2_w", "ln2_b", "w_q2", "b_q2", "w_o2", "b_o2", "ln3_w", "ln3_b", "w_1", "b_1",
                                  "w_2", "b_2", "w_out", "b_out")] + \
               [(n, _I64) for n in ("channels", "groups", "heads", "head_dim", "hidden")] + \
               [(n, _F32) for n in ("gn_eps", "ln1_eps", "ln2_eps", "ln3_eps", "scale")]


class _BlockInputs(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("x", "k_txt", "v_txt", "y", "work")] + \
               [(n, _I64) for n in ("batch", "hw", "ctx_len", "channels_last")]


@functools.cache
def _sgemm() -> int | None:
    """The address of torch's exported sgemm_, or None."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        return ctypes.cast(ctypes.CDLL(str(path)).sgemm_, _P).value
    except (OSError, AttributeError):
        return None


def available() -> bool:
    return library() is not None and _sgemm() is not None


def supports(x: torch.Tensor) -> bool:
    """True for a non-empty fp32 CPU (B, C, H, W) tensor stored NCHW- or channels-last-contiguous, with the kernel
    built on this machine and a BLAS sgemm found in torch."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 4 and x.numel() > 0
            and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)) and available())


def _fp32(name: str, t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != shape:
        raise ValueError(f"spatial transformer: {name} must be an fp32 CPU tensor of shape {shape}, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    return t.detach().contiguous()


class BlockWeights:
    """One block's weights, (out, in) as nn.Linear keeps them; biases and norm affines may be None, and so may the
    whole cross-attention (ln2_w to b_o2). C channels, heads * head_dim inner width,
    ``hidden`` feedforward width; ``ln_eps`` the three LayerNorms' eps, ``scale`` the attention's softmax scale.
    The tensors are copied only where they are not contiguous, except q/k/v, stacked into one (3 * inner, C)."""

    def __init__(self, *, gn_w, gn_b, w_in, b_in, ln1_w, ln1_b, w_q, w_k, w_v, b_q=None, b_k=None, b_v=None,
                 w_o1, b_o1, ln2_w=None, ln2_b=None, w_q2=None, b_q2=None, w_o2=None, b_o2=None, ln3_w, ln3_b,
                 w_1, b_1, w_2, b_2, w_out, b_out, groups: int, heads: int, head_dim: int, gn_eps: float,
                 ln_eps: tuple[float, float, float], scale: float) -> None:
        c, inner, hidden = w_in.shape[0], heads * head_dim, w_1.shape[0]
        if c % groups:
            raise ValueError(f"spatial transformer: groups ({groups}) must divide the channels ({c})")
        if (b_q is None) != (b_k is None) or (b_q is None) != (b_v is None):
            raise ValueError("spatial transformer: give all three of b_q, b_k, b_v or none")
        if (w_q2 is None) != (w_o2 is None):
            raise ValueError("spatial transformer: a cross-attention needs both w_q2 and w_o2")
        qkv_bias = None if b_q is None else torch.cat([b_q, b_k, b_v]).detach()
        shapes = dict(gn_w=(c,), gn_b=(c,), w_in=(c, c), b_in=(c,), ln1_w=(c,), ln1_b=(c,), w_qkv=(3 * inner, c),
                      b_qkv=(3 * inner,), w_o1=(c, inner), b_o1=(c,), ln2_w=(c,), ln2_b=(c,), w_q2=(inner, c),
                      b_q2=(inner,), w_o2=(c, inner), b_o2=(c,), ln3_w=(c,), ln3_b=(c,), w_1=(hidden, c),
                      b_1=(hidden,), w_2=(c, hidden), b_2=(c,), w_out=(c, c), b_out=(c,))
        given = dict(gn_w=gn_w, gn_b=gn_b, w_in=w_in, b_in=b_in, ln1_w=ln1_w, ln1_b=ln1_b,
                     w_qkv=torch.cat([w_q, w_k, w_v]).detach(), b_qkv=qkv_bias, w_o1=w_o1, b_o1=b_o1, ln2_w=ln2_w,
                     ln2_b=ln2_b, w_q2=w_q2, b_q2=b_q2, w_o2=w_o2, b_o2=b_o2, ln3_w=ln3_w, ln3_b=ln3_b, w_1=w_1,
                     b_1=b_1, w_2=w_2, b_2=b_2, w_out=w_out, b_out=b_out)
        self._keep = {name: _fp32(name, t, shapes[name]) for name, t in given.items()}
        self.channels, self.inner, self.cross = c, inner, w_q2 is not None
        self.struct = _BlockWeights(*(None if t is None else t.data_ptr() for t in self._keep.values()), c, groups,
                                    heads, head_dim, hidden, gn_eps, *ln_eps, scale)


def spatial_transformer(weights: BlockWeights, x: torch.Tensor, k_txt: torch.Tensor | None = None,
                        v_txt: torch.Tensor | None = None) -> torch.Tensor:
    """x (B, C, H, W) -> the block's output (B, C, H, W), channels-last; forward only, check ``supports`` first.
    k_txt, v_txt: the cross-attention's key and value projections of the text, (B, M, inner) contiguous, required
    exactly when the block has a cross-attention."""
    b, c, h, w = x.shape
    if c != weights.channels:
        raise ValueError(f"spatial transformer: expected {weights.channels} channels, got {c}")
    if weights.cross != (k_txt is not None and v_txt is not None):
        raise ValueError("spatial transformer: text keys and values are needed exactly when the block has a "
                         "cross-attention")
    ctx_len = 0
    if weights.cross:
        ctx_len = k_txt.shape[1]
        for name, t in (("k_txt", k_txt), ("v_txt", v_txt)):
            if (t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != (b, ctx_len, weights.inner)
                    or not t.is_contiguous()):
                raise ValueError(f"spatial transformer: {name} must be a contiguous fp32 CPU tensor of shape "
                                 f"{(b, ctx_len, weights.inner)}, got {t.dtype} {tuple(t.shape)}")
    if b * h * w * 4 * max(c, weights.inner) > _INT_MAX:
        raise ValueError("spatial transformer: the input is too large for a 32-bit BLAS")
    y = torch.empty((b, c, h, w), memory_format=torch.channels_last)
    inputs = _BlockInputs(x=x.data_ptr(), k_txt=None if k_txt is None else k_txt.data_ptr(),
                          v_txt=None if v_txt is None else v_txt.data_ptr(), y=y.data_ptr(), batch=b, hw=h * w,
                          ctx_len=ctx_len, channels_last=not x.is_contiguous())
    lib = library()
    work = torch.empty(lib.spatial_transformer_work_f32(ctypes.byref(weights.struct), ctypes.byref(inputs)))
    inputs.work = work.data_ptr()
    if lib.spatial_transformer_f32(ctypes.byref(weights.struct), ctypes.byref(inputs), _sgemm()):
        raise MemoryError("spatial transformer: GroupNorm scratch allocation failed")
    return y
