"""A whole Llama-family decoder layer for a CPU engine's decode tokens in one call (csrc/decode_layer.c), fp32.

``LayerKernel`` holds one layer's weights (pointers into the model's own tensors, which it keeps alive);
``StepBuffers`` holds what every layer of one step shares (cache slots, block tables, context lengths, RoPE rows
and scratch). Call ``LayerKernel.run(step, k_cache, v_cache, x)`` per layer.
"""

from __future__ import annotations

import ctypes

import torch

from kernels._cpu_library import library, threads

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _LayerWeights(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("ln1", "wq", "wk", "wv", "bq", "bk", "bv", "wo", "ln2", "wg", "wu", "wd")] + \
               [(n, _I64) for n in ("dim", "hq", "hkv", "d", "ffn", "window")] + [("eps", _F32), ("scale", _F32)]


class _StepInputs(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("slots", "tables", "lens", "cos", "sin", "h", "q", "k", "v", "att", "act")] + \
               [(n, _I64) for n in ("m", "block_size", "max_blocks")]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _fp32(t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != shape:
        raise ValueError(f"decode layer: expected a contiguous fp32 CPU tensor of shape {shape}, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    return t


def available() -> bool:
    return library() is not None


class StepBuffers:
    """Per-step inputs shared by every layer: slots (M,) long, tables (M, max_blocks) int32, lens (M,) int32,
    cos/sin (M, D/2) fp32 rows for each token's position, and scratch sized for M tokens."""

    def __init__(self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, *, block_size: int, dim: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 ffn: int):
        m = slots.shape[0]
        self._keep = [slots.long().contiguous(), tables.to(torch.int32).contiguous(), lens.to(torch.int32).contiguous(),
                      _fp32(cos.contiguous(), (m, head_dim // 2)), _fp32(sin.contiguous(), (m, head_dim // 2))]
        self._keep += [torch.empty(m, n) for n in (dim, n_heads * head_dim, n_kv_heads * head_dim,
                                                   n_kv_heads * head_dim, n_heads * head_dim, ffn)]
        self.struct = _StepInputs(*(t.data_ptr() for t in self._keep), m, block_size, self._keep[1].shape[1])


class LayerKernel:
    """One layer's weights: RMSNorm gains ln1/ln2 (dim,), q/k/v/o projections (biases only on q/k/v, optional),
    SwiGLU gate/up (ffn, dim) and down (dim, ffn); ``window`` > 0 is a sliding attention window."""

    def __init__(self, *, ln1, wq, wk, wv, wo, ln2, wg, wu, wd, bq=None, bk=None, bv=None, n_heads: int,
                 n_kv_heads: int, head_dim: int, eps: float, scale: float, window: int = 0):
        dim, ffn = ln1.shape[0], wg.shape[0]
        nq, nkv = n_heads * head_dim, n_kv_heads * head_dim
        shapes = dict(ln1=(dim,), wq=(nq, dim), wk=(nkv, dim), wv=(nkv, dim), wo=(dim, nq), ln2=(dim,),
                      wg=(ffn, dim), wu=(ffn, dim), wd=(dim, ffn), bq=(nq,), bk=(nkv,), bv=(nkv,))
        given = dict(ln1=ln1, wq=wq, wk=wk, wv=wv, bq=bq, bk=bk, bv=bv, wo=wo, ln2=ln2, wg=wg, wu=wu, wd=wd)
        self._keep = {name: _fp32(t, shapes[name]) for name, t in given.items()}
        self.struct = _LayerWeights(*(_ptr(t) for t in self._keep.values()), dim, n_heads, n_kv_heads, head_dim,
                                    ffn, window, eps, scale)

    def run(self, step: StepBuffers, k_cache: torch.Tensor, v_cache: torch.Tensor, x: torch.Tensor) -> None:
        """x (M, dim) fp32 contiguous, updated in place; the step's k/v go into the caches at their slots."""
        if library().decode_layer_f32(ctypes.addressof(self.struct), ctypes.addressof(step.struct), k_cache.data_ptr(),
                                      v_cache.data_ptr(), x.data_ptr(), threads()):
            raise MemoryError("decode layer: attention scratch allocation failed")
