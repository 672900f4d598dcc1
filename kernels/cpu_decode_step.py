"""A whole decode step of a Llama-family model for a CPU engine's decode tokens in one call (csrc/decode_step.c),
with fp32 activations: the embedding lookup, every layer, the final RMSNorm and the LM head, without leaving one
OpenMP region. Each projection and the LM head is an fp32 or bf16 tensor, a ``QuantWeight`` (a GGUF checkpoint's
Q8_0/Q4_0/Q4_1 blocks) or ``Int8Rows`` (int8 weights with per-row scales), widened inside the products; the
embedding and the K/V caches are fp32 or bf16.

``LayerWeights`` holds one layer's weights (pointers into the model's own tensors, which it keeps alive);
``StepKernel`` all layers plus the embedding, the final norm and the head, and reusable scratch per batch size.
``StepKernel.run(...)`` takes the step's token ids, positions, cache slots, block tables and context lengths and
returns the logits: after the C call returns, the only tensor op of a step is allocating them. With a hybrid KV cache
(services/text/engine/kv_cache.py) the layers fall into groups with tables of their own: the slots and tables then
come per group, and each layer reads its group's.

LoRA adapters (services/text/adapter_slots.py): a layer may hold, per projection, adapter slots A (slots, R, in),
B (slots, out, R) with the scale folded in, and each slot's rank (slots,) int32; a step then takes each token's slot
(-1: none) and adds its delta (x A^T) B^T right after the product it adapts, in the same parallel region.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from genserve.kernels._cpu_library import library, threads
from genserve.kernels.quant_formats import quant_format, row_bytes

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


_MATRICES = ("wq", "wk", "wv", "wo", "wg", "wu", "wd")  # the order of the C struct's types[] and scales[]
LORA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the same order, by module
BF16_TYPE = 30  # GGML's id for bf16 rows (csrc/quant.h)
INT8_ROWS_TYPE = 1024  # ours: int8 rows, each product times its row's scale (csrc/quant.h)
_BLOCK = 32  # bf16 and int8 rows are read in blocks of 32 values


class _LayerWeights(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("ln1", "wq", "wk", "wv", "bq", "bk", "bv", "wo", "ln2", "wg", "wu", "wd")] + \
               [(n, _I64) for n in ("dim", "hq", "hkv", "d", "ffn", "window")] + [("eps", _F32), ("scale", _F32)] + \
               [("types", ctypes.c_int32 * len(_MATRICES)), ("scales", _P * len(_MATRICES)), ("qn", _P), ("kn", _P)] + \
               [(n, _P * len(_MATRICES)) for n in ("lora_a", "lora_b", "lora_ranks")]


@dataclass(frozen=True)
class QuantWeight:
    """A weight matrix (out_features, in_features) kept as GGUF blocks: ``blocks`` uint8 (out, row bytes),
    ``qtype`` a name or GGML type id of kernels/quant_formats.py."""

    blocks: torch.Tensor
    qtype: str | int


@dataclass(frozen=True)
class Int8Rows:
    """A weight matrix (out_features, in_features) as int8 ``weight`` rows times per-row ``scales`` (out_features,):
    services/text/quantize.py's Int8Linear."""

    weight: torch.Tensor
    scales: torch.Tensor


Matrix = torch.Tensor | QuantWeight | Int8Rows


def _out_features(w: Matrix) -> int:
    if isinstance(w, QuantWeight):
        return w.blocks.shape[0]
    return (w.weight if isinstance(w, Int8Rows) else w).shape[0]


def fused_matrix_ok(w: Matrix) -> bool:
    """True when the kernel reads ``w`` as it is: fp32 of any width on the CPU; bf16 and int8 rows (read in blocks
    of 32) when in_features is a multiple of 32; GGUF blocks always (their rows are whole blocks)."""
    if isinstance(w, QuantWeight):
        return w.blocks.device.type == "cpu"
    t = w.weight if isinstance(w, Int8Rows) else w
    if t.device.type != "cpu" or t.dim() != 2:
        return False
    if isinstance(w, Int8Rows):
        return t.dtype == torch.int8 and t.shape[1] % _BLOCK == 0
    return t.dtype == torch.float32 or (t.dtype == torch.bfloat16 and t.shape[1] % _BLOCK == 0)


def _matrix(w: Matrix, shape: tuple[int, int]) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """A projection as (the tensor the kernel reads, its type id: 0 for fp32, its per-row scales or None);
    ValueError on a misfit."""
    if not fused_matrix_ok(w):
        raise ValueError(f"decode step: a {shape} projection the kernel cannot read (fp32, bf16 or int8 rows with "
                         f"in_features a multiple of {_BLOCK}, or GGUF blocks, on the CPU)")
    if isinstance(w, Int8Rows):
        return _typed(w.weight, torch.int8, shape), INT8_ROWS_TYPE, _typed(w.scales, torch.float32, shape[:1])
    if isinstance(w, torch.Tensor):
        if w.dtype == torch.bfloat16:
            return _typed(w, torch.bfloat16, shape), BF16_TYPE, None
        return _fp32(w, shape), 0, None
    fmt = quant_format(w.qtype)
    blocks = w.blocks
    expected = (shape[0], row_bytes(fmt, shape[1]))
    if blocks.dtype != torch.uint8 or blocks.device.type != "cpu" or not blocks.is_contiguous() or \
            tuple(blocks.shape) != expected:
        raise ValueError(f"decode step: expected contiguous uint8 {fmt.name} blocks of shape {expected} on the CPU, "
                         f"got {blocks.dtype} {tuple(blocks.shape)} on {blocks.device}")
    return blocks, fmt.ggml_type, None


class _StepInputs(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("tokens", "positions", "slots", "tables", "lens", "embed", "cos", "sin", "h", "q",
                                  "k", "v", "att", "act")] + \
               [(n, _I64) for n in ("m", "block_size", "max_blocks", "vocab", "n_positions", "embed_bf16",
                                    "cache_bf16")] + [("lora_slots", _P), ("lora_t", _P), ("lora_r", _I64)] + \
               [("layer_groups", _P), ("n_groups", _I64)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _fp32(t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != shape:
        raise ValueError(f"decode step: expected a contiguous fp32 CPU tensor of shape {shape}, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    return t


def _fp32_or_bf16(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return _typed(t, torch.bfloat16, shape) if t.dtype == torch.bfloat16 else _fp32(t, shape)


def _typed(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ValueError(f"decode step: expected shape {shape}, got {tuple(t.shape)}")
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def available() -> bool:
    return library() is not None


class LayerWeights:
    """One layer's weights: RMSNorm gains ln1/ln2 (dim,) and q/k/v biases (optional) in fp32, q/k/v/o projections,
    SwiGLU gate/up (ffn, dim) and down (dim, ffn), each matrix a ``Matrix`` the kernel reads (``fused_matrix_ok``);
    ``window`` > 0 is a sliding attention window; ``q_norm``/``k_norm`` (head_dim,) fp32 gains of QK-norm (Qwen3),
    applied per head before RoPE. ``lora``: projection name (``LORA``) -> its adapter slots, anything with fp32
    ``a`` (slots, R, in), ``b`` (slots, out, R) and int32 ``ranks`` (slots,) (shared/blocks/lora.py's LoraStack)."""

    def __init__(self, *, ln1, wq, wk, wv, wo, ln2, wg, wu, wd, bq=None, bk=None, bv=None, n_heads: int,
                 n_kv_heads: int, head_dim: int, eps: float, scale: float, window: int = 0,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, lora: dict | None = None):
        dim, ffn = ln1.shape[0], _out_features(wg)
        nq, nkv = n_heads * head_dim, n_kv_heads * head_dim
        shapes = dict(ln1=(dim,), wq=(nq, dim), wk=(nkv, dim), wv=(nkv, dim), wo=(dim, nq), ln2=(dim,),
                      wg=(ffn, dim), wu=(ffn, dim), wd=(dim, ffn), bq=(nq,), bk=(nkv,), bv=(nkv,))
        given = dict(ln1=ln1, wq=wq, wk=wk, wv=wv, bq=bq, bk=bk, bv=bv, wo=wo, ln2=ln2, wg=wg, wu=wu, wd=wd)
        typed = {name: _matrix(t, shapes[name]) if name in _MATRICES else (_fp32(t, shapes[name]), 0, None)
                 for name, t in given.items()}
        self._keep = {name: t for name, (t, _, _) in typed.items()}
        self._scales = [typed[name][2] for name in _MATRICES]
        self.dim = dim
        types = (ctypes.c_int32 * len(_MATRICES))(*(typed[name][1] for name in _MATRICES))
        scales = (_P * len(_MATRICES))(*map(_ptr, self._scales))
        self._qk_norm = [_fp32(t, (head_dim,)) for t in (q_norm, k_norm)]
        self._lora = [_lora_slots(lora.get(name), shapes[m]) if lora else (None, None, None)
                      for name, m in zip(LORA, _MATRICES, strict=True)]
        lora_arrays = [(_P * len(_MATRICES))(*(_ptr(s[j]) for s in self._lora)) for j in range(3)]
        self.struct = _LayerWeights(*(_ptr(t) for t in self._keep.values()), dim, n_heads, n_kv_heads, head_dim,
                                    ffn, window, eps, scale, types, scales, *map(_ptr, self._qk_norm), *lora_arrays)


def _lora_slots(stack, shape: tuple[int, int]) -> tuple[torch.Tensor | None, ...]:
    """(A, B, ranks) of one projection's adapter slots as the kernel reads them; Nones where there are none."""
    if stack is None:
        return None, None, None
    slots, rank = stack.a.shape[:2]
    a = _fp32(stack.a, (slots, rank, shape[1]))
    b = _fp32(stack.b, (slots, shape[0], rank))
    return a, b, _typed(stack.ranks, torch.int32, (slots,))


class StepKernel:
    """All layers between the embedding (vocab, dim; fp32 or bf16) and the final RMSNorm (fp32 gain ``norm`` (dim,),
    ``eps``) + LM head (vocab, dim; a ``Matrix``), no bias; RoPE tables cos/sin (n_positions, head_dim / 2) in the
    rotate-half layout. One caller at a time (the engine loop): the scratch and the step struct are shared by every
    call."""

    def __init__(self, layers: list[LayerWeights], *, embed: torch.Tensor, norm: torch.Tensor, eps: float,
                 head: Matrix, n_heads: int, n_kv_heads: int, head_dim: int, ffn: int, lora_rank: int = 0):
        """``lora_rank``: R of the layers' adapter slots (0: none)."""
        dim = layers[0].dim
        if any(layer.dim != dim for layer in layers):
            raise ValueError("decode step: every layer must have the same width")
        self._layers = layers  # keeps the weights the structs point into alive
        self._embed, self._norm = _fp32_or_bf16(embed, (embed.shape[0], dim)), _fp32(norm, (dim,))
        self._head, self._head_type, self._head_scales = _matrix(head, (_out_features(head), dim))
        self._eps = eps
        self._lora_rank = lora_rank
        self._widths = (dim, dim, n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim,
                        n_heads * head_dim, ffn)  # x, h, q, k, v, att, act
        # per batch size M, reused by every step of that size: the struct and the scratch tensors it points at
        self._steps: dict[int, tuple[_StepInputs, list[torch.Tensor]]] = {}
        self._structs = (_LayerWeights * len(layers))(*(layer.struct for layer in layers))
        self._caches: tuple[tuple[int, ...], ctypes.Array, ctypes.Array] | None = None

    def _cache_arrays(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        key = tuple(t.data_ptr() for t in (*k_caches, *v_caches))
        if self._caches is None or self._caches[0] != key:  # the engine keeps its caches, so built once
            n = len(self._layers)
            if len(k_caches) != n or len(v_caches) != n:
                raise ValueError(f"decode step: expected {n} key and value caches")
            dtypes = {t.dtype for t in (*k_caches, *v_caches)}
            if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16} or \
                    not all(t.is_contiguous() and t.device.type == "cpu" for t in (*k_caches, *v_caches)):
                raise ValueError(f"decode step: the caches must be contiguous CPU tensors, all fp32 or all bf16; got "
                                 f"{sorted(map(str, dtypes))}")
            self._caches = (key, (_P * n)(*key[:n]), (_P * n)(*key[n:]))
        return self._caches[1], self._caches[2]

    def _step_inputs(self, m: int) -> tuple[_StepInputs, list[torch.Tensor]]:
        """The step struct for batch size m with its scratch (x, h, q, k, v, att, act), the scratch pointers filled
        once; the caller sets the per-step fields."""
        if m not in self._steps:
            scratch = [torch.empty(m, n) for n in self._widths]
            scratch.append(torch.empty(len(_MATRICES), m, self._lora_rank))  # each adapted product's x A^T
            step = _StepInputs(embed=self._embed.data_ptr(), vocab=self._embed.shape[0], m=m,
                               embed_bf16=int(self._embed.dtype == torch.bfloat16), lora_t=scratch[-1].data_ptr(),
                               lora_r=self._lora_rank,
                               **{name: t.data_ptr() for name, t in zip(("h", "q", "k", "v", "att", "act"),
                                                                        scratch[1:-1], strict=True)})
            self._steps[m] = step, scratch
        return self._steps[m]

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
            lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_caches: list[torch.Tensor],
            v_caches: list[torch.Tensor], lora: torch.Tensor | None = None, groups: torch.Tensor | None = None
            ) -> torch.Tensor:
        """tokens, positions, slots (M,) int64; tables (M, max_blocks) and lens (M,) int32 (context length including
        the token) -> logits (M, vocab). Each token's k/v go into the caches (num_blocks, block_size, Hkv, D) at
        its slot. ``lora``: each token's adapter slot (M,) int32, -1 for none (None: no adapter in the step).
        ``groups``: each layer's KV group (L,) int64 with slots (G, M) and tables (G, M, max_blocks), one per group
        (None: one group, the shapes above). ValueError for a token id or position outside the embedding or RoPE
        tables."""
        logits, _ = self._call(None, tokens, positions, slots, tables, lens, cos, sin, k_caches, v_caches, lora,
                               groups)
        return logits

    def greedy(self, steps: int, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               tables: torch.Tensor, lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], lora: torch.Tensor | None = None,
               groups: torch.Tensor | None = None) -> torch.Tensor:
        """``steps`` greedy decode steps in one call, each row's argmax fed back at its next position: the tokens
        (M, steps) int64. Arguments as for ``run``, for the first step; ``tables`` must already hold the blocks of
        every position up to positions + steps - 1 (ValueError otherwise, before anything is computed)."""
        if steps < 1:
            raise ValueError(f"decode step: steps must be >= 1, got {steps}")
        _, out = self._call(steps, tokens, positions, slots, tables, lens, cos, sin, k_caches, v_caches, lora, groups)
        return out

    def _call(self, steps: int | None, tokens, positions, slots, tables, lens, cos, sin, k_caches, v_caches, lora,
              groups) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = tokens.shape[0]
        lead: tuple[int, ...] = ()  # the group dimension of slots and tables
        if groups is not None:
            lead = (slots.shape[0],)
            groups = _typed(groups, torch.int64, (len(self._layers),))  # kept alive until the call returns
            if not bool(((groups >= 0) & (groups < lead[0])).all()):
                raise ValueError(f"decode step: a layer's KV group is outside [0, {lead[0]})")
        ints = [*(_typed(t, torch.int64, (m,)) for t in (tokens, positions)), _typed(slots, torch.int64, (*lead, m)),
                _typed(tables, torch.int32, (*lead, m, tables.shape[-1])), _typed(lens, torch.int32, (m,))]
        if lora is not None:
            if not self._lora_rank:
                raise ValueError("decode step: adapter slots given to a kernel built without LoRA (lora_rank 0)")
            lora = _typed(lora, torch.int32, (m,))  # kept alive until the call returns
        cos, sin = _fp32(cos, (cos.shape[0], cos.shape[-1])), _fp32(sin, tuple(cos.shape))
        step, (x, *_) = self._step_inputs(m)
        step.tokens, step.positions, step.slots, step.tables, step.lens = (t.data_ptr() for t in ints)
        step.lora_slots = _ptr(lora)
        step.layer_groups, step.n_groups = _ptr(groups), lead[0] if lead else 1
        step.cos, step.sin, step.n_positions = cos.data_ptr(), sin.data_ptr(), cos.shape[0]
        step.block_size, step.max_blocks = k_caches[0].shape[1], tables.shape[-1]
        keys, values = self._cache_arrays(k_caches, v_caches)
        step.cache_bf16 = int(k_caches[0].dtype == torch.bfloat16)
        logits = torch.empty(m, self._head.shape[0])
        args = (ctypes.addressof(self._structs), len(self._layers), ctypes.addressof(step), keys, values,
                x.data_ptr(), self._norm.data_ptr(), self._eps, self._head.data_ptr(), self._head_type,
                _ptr(self._head_scales), self._head.shape[0], logits.data_ptr())
        out = None
        if steps is None:  # one step, sampled by the caller
            status = library().decode_step_f32(*args, threads())
        else:
            out = torch.empty(m, steps, dtype=torch.int64)
            status = library().decode_steps_f32(*args, steps, out.data_ptr(), threads())
        if status == -2:
            raise ValueError(f"decode step: a token id is outside [0, {self._embed.shape[0]}), a position outside "
                             f"[0, {cos.shape[0]}), or a block table too short for the steps")
        if status:
            raise MemoryError("decode step: scratch allocation failed")
        return logits, out
