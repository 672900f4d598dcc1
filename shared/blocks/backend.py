"""The single dispatch point between the building blocks and the compute that runs them.

`get_backend(name=None)` returns a backend object; the name comes from the `GENSERVE_BACKEND` environment variable
when not given: "auto" (default), "reference", "torch" or "triton". Every backend has the same twelve methods (the
contract in docs/architecture.md):

- attend(q, k, v, *, causal, sm_scale=None, window=0, softcap=0.0, sinks=None): q (B, Hq, Nq, D), k/v (B, Hkv, Nk,
  D), Hq % Hkv == 0 (GQA read natively); the causal mask is bottom-right aligned (query i sees keys j <= i + Nk - Nq);
  a sliding `window` > 0 (causal only) also hides keys j <= i + Nk - Nq - window (masks.sliding_window_mask);
  `softcap` > 0 caps the scores at +-softcap (tanh) and `sinks` (Hq,) adds one sink logit per head to every row's
  softmax (sdpa.py);
- paged_decode(q, k_cache, v_cache, block_tables, context_lens, *, sm_scale=None, window=0, softcap=0.0, sinks=None):
  q (B, Hq, D), caches (num_blocks, block_size, Hkv, D), block_tables int32 (B, max_blocks), context_lens int32 (B,)
  -> (B, Hq, D); with a `window`, each sequence attends to its last `window` keys only; softcap and sinks as above;
- mla_decode(q, cache, block_tables, context_lens, *, latent_dim, sm_scale=None, window=0): multi-head latent
  attention's absorbed decode (shared/blocks/mla.py): q (B, H, d_c + d_r), one cache (num_blocks, block_size, 1,
  d_c + d_r) that serves as the keys of every head and, its first `latent_dim` (d_c) columns, as their values
  -> (B, H, d_c);
- rms_norm(x, weight, eps, residual=None): y, or (y, x + residual) with the norm taken of x + residual;
- apply_rope(q, k, cos, sin, positions, *, interleaved=False): (q, k) rotated; cos/sin are (P, D/2) tables;
- linear(x, weight, bias=None): y = x W^T + b, weight (N, K) as in nn.Linear;
- quant_linear(x, blocks, qtype, bias=None): the same with W kept in GGUF's quantised blocks (Q8_0, Q4_0, Q4_1):
  blocks uint8 (N, K / 32 * block bytes), qtype a name or GGML type id (kernels/quant_formats.py);
- conv2d(x, weight, bias=None, *, stride, padding, prepared=None): F.conv2d with dilation 1 and groups 1; `prepared`
  is the calling module's `PreparedWeights`, where a backend may keep the weight in the layout its compute wants;
- group_norm(x, groups, weight=None, bias=None, eps=1e-5, *, silu=False): F.group_norm, then F.silu when `silu`;
- spatial_transformer(x, block, context): a U-Net SpatialTransformer ``block`` (shared/blocks/unet.py) applied to x
  in one fused call, or None where the backend has no fused form for x and the block runs its own ops;
- experts(x, block, weights, idx): a mixture-of-experts ``block``'s (shared/blocks/moe.py) routed experts for tokens
  x (N, dim) with routing weights and expert ids (N, k), in one fused call, or None where the block runs its own
  grouped loop;
- lora(y, x, stack, mapping): y (N, out) += each token's adapter delta (x_i A_s^T) B_s^T, s its slot in `mapping`,
  from the slots of a `LoraStack` (shared/blocks/lora.py), in place; returns y.

"reference" is the math of the chapter "Deep Learning Building Blocks" written out, "torch" uses fused torch ops
(SDPA), "triton" calls the kernels package, and "auto" picks triton for CUDA tensors when triton is importable and no
gradient is needed (the kernels are forward-only), and torch otherwise. On the CPU, "torch" runs the decode step's
hot spots on the C kernels of the kernels package (kernels/cpu_gemv.py, kernels/cpu_paged_decode.py): matrix-vector
products that stream weights at close to memory bandwidth where MKL does not, and paged attention in one call instead
of a dozen tensor ops; products with GGUF-quantised weights that dequantise each block inside the matrix-vector loop
(kernels/cpu_quant.py; "triton" runs kernels/quant_matmul.py for them); convolutions on oneDNN, small ones with the
weight reordered once instead of on every call, the path chosen by one image's size so that batching never changes
an image (kernels/cpu_conv.py),
GroupNorm + SiLU in one pass over either memory layout (kernels/cpu_group_norm.py), and a U-Net's whole spatial
transformer in one call on the BLAS sgemm (kernels/cpu_spatial_transformer.py).
Modules hold a backend and never branch on devices themselves.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

from genserve.kernels.cpu_gemv import MAX_ROWS as GEMV_MAX_ROWS
from genserve.kernels.quant_formats import dequantize
from genserve.shared.blocks import rope as _rope
from genserve.shared.blocks.lora import LoraMapping, LoraStack, lora_add
from genserve.shared.blocks.masks import causal_mask, sliding_window_mask
from genserve.shared.blocks.sdpa import scaled_dot_product_attention

BACKEND_NAMES = ("auto", "reference", "torch", "triton")
ENV_VAR = "GENSERVE_BACKEND"


def _gather_paged(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(num_blocks, bs, Hkv, D) gathered by (B, M) tables -> (B, Hkv, M*bs, D); unused table entries are clamped."""
    tables = block_tables.long().clamp(0, cache.shape[0] - 1)
    blocks = cache[tables]  # (B, M, bs, Hkv, D)
    b, m, bs, h, d = blocks.shape
    return blocks.reshape(b, m * bs, h, d).transpose(1, 2)


def _paged_keys(q, k_cache, v_cache, block_tables, context_lens, window: int):
    """Every sequence's cached keys and values gathered (B, Hkv, M*bs, D), and the keep-mask (B, 1, 1, M*bs) of its
    context (its last `window` keys with a window)."""
    k = _gather_paged(k_cache, block_tables)
    v = _gather_paged(v_cache, block_tables)
    pos = torch.arange(k.shape[2], device=q.device)[None, :]
    lens = context_lens.to(q.device).long()[:, None]
    keep = (pos < lens) & (pos >= lens - window) if window else pos < lens
    return k, v, keep[:, None, None, :]


class PreparedWeights(dict):
    """A module's store for what a backend derives from its weights (e.g. a copy reordered for oneDNN). Derived
    data only: copies and pickles of the module start with it empty, as oneDNN tensors can be neither."""

    def __deepcopy__(self, memo: dict) -> PreparedWeights:
        return PreparedWeights()

    def __reduce__(self):
        return PreparedWeights, ()


def _keep_mask(q: torch.Tensor, k: torch.Tensor, causal: bool, window: int) -> torch.Tensor | None:
    """The (Nq, Nk) keep-mask of `attend`: None, causal, or causal with a sliding window."""
    if window < 0 or (window and not causal):
        raise ValueError(f"window must be >= 0 and needs causal attention; got window={window}, causal={causal}")
    if window:
        return sliding_window_mask(q.shape[2], k.shape[2], window, q.device)
    return causal_mask(q.shape[2], k.shape[2], q.device) if causal else None


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class ReferenceBackend:
    """The chapter's equations written out: Def. 12 "Scaled Dot-Product Attention",
    Def. 19 "Root Mean Square Layer Normalisation" and the RoPE rotation of equation ROPE QK."""

    name = "reference"

    def attend(self, q, k, v, *, causal: bool, sm_scale: float | None = None, window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return scaled_dot_product_attention(q, k, v, _keep_mask(q, k, causal, window), sm_scale=sm_scale,
                                            softcap=softcap, sinks=sinks)

    def paged_decode(self, q, k_cache, v_cache, block_tables, context_lens, *, sm_scale=None, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        bs = k_cache.shape[1]
        out = []
        for b in range(q.shape[0]):
            n = int(context_lens[b])
            start = max(0, n - window) if window else 0
            blocks = block_tables[b, : (n + bs - 1) // bs].long()
            k = k_cache[blocks].flatten(0, 1)[start:n].transpose(0, 1)  # (Hkv, n - start, D)
            v = v_cache[blocks].flatten(0, 1)[start:n].transpose(0, 1)
            o = scaled_dot_product_attention(q[b, None, :, None], k[None], v[None], sm_scale=sm_scale, softcap=softcap,
                                             sinks=sinks)  # (1, Hq, 1, D)
            out.append(o[0, :, 0])
        return torch.stack(out)  # (B, Hq, D)

    def mla_decode(self, q, cache, block_tables, context_lens, *, latent_dim: int, sm_scale=None,
                   window: int = 0) -> torch.Tensor:
        return self.paged_decode(q, cache, cache, block_tables, context_lens, sm_scale=sm_scale,
                                 window=window)[..., :latent_dim]

    def rms_norm(self, x, weight, eps: float, residual=None):
        if residual is not None:
            x = x + residual
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = weight * y.to(x.dtype)
        return y if residual is None else (y, x)

    def apply_rope(self, q, k, cos, sin, positions, *, interleaved: bool = False):
        return _rope.apply_rope(q, k, cos, sin, positions, interleaved)

    def linear(self, x, weight, bias=None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def quant_linear(self, x, blocks, qtype, bias=None) -> torch.Tensor:
        return F.linear(x, dequantize(blocks, qtype, x.shape[-1]).to(x.dtype), bias)

    def conv2d(self, x, weight, bias=None, *, stride, padding, prepared=None) -> torch.Tensor:
        return F.conv2d(x, weight, bias, stride, padding)

    def group_norm(self, x, groups: int, weight=None, bias=None, eps: float = 1e-5, *, silu: bool = False):
        y = F.group_norm(x, groups, weight, bias, eps)
        return F.silu(y) if silu else y

    def spatial_transformer(self, x, block, context) -> torch.Tensor | None:
        return None  # the block runs its own ops

    def experts(self, x, block, weights, idx) -> torch.Tensor | None:
        return None  # the block's grouped loop over its experts

    def lora(self, y: torch.Tensor, x: torch.Tensor, stack: LoraStack, mapping: LoraMapping) -> torch.Tensor:
        return lora_add(y, x, stack, mapping)  # one shrink and one expand product per adapter's rows


class TorchBackend(ReferenceBackend):
    """Fused torch ops: F.scaled_dot_product_attention with native GQA, F.rms_norm."""

    name = "torch"

    def attend(self, q, k, v, *, causal: bool, sm_scale: float | None = None, window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        if softcap or sinks is not None:  # scores SDPA cannot shape: the written-out attention
            return super().attend(q, k, v, causal=causal, sm_scale=sm_scale, window=window, softcap=softcap,
                                  sinks=sinks)
        nq, nk = q.shape[2], k.shape[2]
        gqa = q.shape[1] != k.shape[1]
        if not causal and not window and q.device.type == "cpu":
            from genserve.kernels import cpu_attention

            if cpu_attention.supports(q, k, v):  # small heads, e.g. a DiT's: per-score costs dominate SDPA's
                return cpu_attention.attention(q, k, v, sm_scale=sm_scale)
        if window and window < nk:
            mask = _keep_mask(q, k, causal, window)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=gqa)
        if not causal or nq == 1:  # a single last query sees every key
            return F.scaled_dot_product_attention(q, k, v, scale=sm_scale, enable_gqa=gqa)
        if nq == nk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sm_scale, enable_gqa=gqa)
        # SDPA's is_causal is top-left aligned; chunked prefill needs bottom-right, so pass the mask explicitly.
        mask = causal_mask(nq, nk, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=gqa)

    def paged_decode(self, q, k_cache, v_cache, block_tables, context_lens, *, sm_scale=None, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if softcap or sinks is not None:
            return self._paged_decode_capped(q, k_cache, v_cache, block_tables, context_lens, sm_scale, window,
                                             softcap, sinks)
        if q.device.type == "cpu" and not window and not _needs_grad(q):
            from genserve.kernels import cpu_paged_decode

            if cpu_paged_decode.supports(q, k_cache, v_cache):
                return cpu_paged_decode.paged_decode(q, k_cache, v_cache, block_tables, context_lens,
                                                     sm_scale=sm_scale)
        k, v, mask = _paged_keys(q, k_cache, v_cache, block_tables, context_lens, window)
        gqa = q.shape[1] != k.shape[1]
        o = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=sm_scale, enable_gqa=gqa)
        return o[:, :, 0]

    @staticmethod
    def _paged_decode_capped(q, k_cache, v_cache, block_tables, context_lens, sm_scale, window, softcap, sinks
                             ) -> torch.Tensor:
        """paged_decode with soft-capped scores or sinks: every sequence's keys gathered at once, written-out
        attention (sdpa.py)."""
        k, v, mask = _paged_keys(q, k_cache, v_cache, block_tables, context_lens, window)
        o = scaled_dot_product_attention(q[:, :, None], k, v, mask, sm_scale=sm_scale,
                                         softcap=softcap, sinks=sinks)
        return o[:, :, 0]

    def rms_norm(self, x, weight, eps: float, residual=None):
        if residual is not None:
            x = x + residual
        y = weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
        return y if residual is None else (y, x)

    def linear(self, x, weight, bias=None) -> torch.Tensor:
        few_rows = x.device.type == "cpu" and x.numel() <= GEMV_MAX_ROWS * x.shape[-1]
        if few_rows and not _needs_grad(x, weight, bias):
            from genserve.kernels import cpu_gemv  # imported on the first decode-sized call only

            if cpu_gemv.supports(x, weight):
                return cpu_gemv.gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    def quant_linear(self, x, blocks, qtype, bias=None) -> torch.Tensor:
        if x.device.type == "cpu" and not _needs_grad(x, bias):
            from genserve.kernels import cpu_quant

            if cpu_quant.supports(x, blocks):
                return cpu_quant.linear(x, blocks, qtype, bias)
        return super().quant_linear(x, blocks, qtype, bias)

    def conv2d(self, x, weight, bias=None, *, stride, padding, prepared=None) -> torch.Tensor:
        if x.device.type == "cpu" and not _needs_grad(x, weight, bias):
            from genserve.kernels import cpu_conv

            # the path depends on one image's size, never on the batch's: batched images stay bit-identical
            if prepared is not None and cpu_conv.supports(x, weight, stride, padding):
                return cpu_conv.conv2d(x, weight, bias, stride, padding, prepared)
            if cpu_conv.onednn(x, weight):
                return cpu_conv.unprepared(x, weight, bias, stride, padding)
        return F.conv2d(x, weight, bias, stride, padding)

    def group_norm(self, x, groups: int, weight=None, bias=None, eps: float = 1e-5, *, silu: bool = False):
        if x.device.type == "cpu" and not _needs_grad(x, weight, bias):
            from genserve.kernels import cpu_group_norm

            if cpu_group_norm.supports(x):
                return cpu_group_norm.group_norm(x, groups, weight, bias, eps, silu=silu)
        return super().group_norm(x, groups, weight, bias, eps, silu=silu)

    def spatial_transformer(self, x, block, context) -> torch.Tensor | None:
        if x.device.type != "cpu" or block.training or not block.fusable or _needs_grad(x, block.proj_in.weight):
            return None
        from genserve.kernels import cpu_spatial_transformer

        if not cpu_spatial_transformer.supports(x):
            return None
        prepared = block.prepared
        if "params" not in prepared:
            params = tuple(block.parameters())
            # weights created under inference_mode track no versions, so what is derived from them could go stale
            prepared["params"] = None if any(p.is_inference() for p in params) else params
        if prepared["params"] is None:
            return None
        key = tuple((p.data_ptr(), p._version) for p in prepared["params"])
        if prepared.get("key") != key:
            prepared["weights"] = cpu_spatial_transformer.BlockWeights(**block.kernel_weights())
            prepared["key"] = key
        kv = block.text_keys_values(context)
        return cpu_spatial_transformer.spatial_transformer(prepared["weights"], x, *(kv or ()))


class TritonBackend:
    """The Triton kernels of the `kernels` package (imported on first use, so CPU-only imports stay light)."""

    name = "triton"

    def __init__(self) -> None:
        self._kernels = None

    @property
    def kernels(self):
        if self._kernels is None:
            from genserve import kernels

            self._kernels = kernels
        return self._kernels

    def attend(self, q, k, v, *, causal: bool, sm_scale: float | None = None, window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, window=window, softcap=softcap,
                                            sinks=sinks)

    def paged_decode(self, q, k_cache, v_cache, block_tables, context_lens, *, sm_scale=None, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, sm_scale=sm_scale,
                                                   window=window, softcap=softcap, sinks=sinks)

    def mla_decode(self, q, cache, block_tables, context_lens, *, latent_dim: int, sm_scale=None,
                   window: int = 0) -> torch.Tensor:
        return self.kernels.mla_decode_attention(q, cache, block_tables, context_lens, latent_dim=latent_dim,
                                                 sm_scale=sm_scale, window=window)

    def rms_norm(self, x, weight, eps: float, residual=None):
        return self.kernels.rms_norm(x, weight, eps, residual=residual)

    def apply_rope(self, q, k, cos, sin, positions, *, interleaved: bool = False):
        return self.kernels.apply_rope(q, k, cos, sin, positions, interleaved=interleaved)

    def linear(self, x, weight, bias=None) -> torch.Tensor:
        return F.linear(x, weight, bias)  # cuBLAS

    def quant_linear(self, x, blocks, qtype, bias=None) -> torch.Tensor:
        return self.kernels.quant_linear(x, blocks, qtype, bias)

    def conv2d(self, x, weight, bias=None, *, stride, padding, prepared=None) -> torch.Tensor:
        return F.conv2d(x, weight, bias, stride, padding)  # cuDNN

    def group_norm(self, x, groups: int, weight=None, bias=None, eps: float = 1e-5, *, silu: bool = False):
        return ReferenceBackend.group_norm(self, x, groups, weight, bias, eps, silu=silu)

    def spatial_transformer(self, x, block, context) -> torch.Tensor | None:
        return None  # the block's own ops, on cuBLAS and the attention kernel

    def experts(self, x, block, weights, idx) -> torch.Tensor | None:
        if not block.fusable:
            return None
        from genserve.kernels.fused_moe import fused_moe

        return fused_moe(x, *block.stacked(), weights, idx)

    def lora(self, y: torch.Tensor, x: torch.Tensor, stack: LoraStack, mapping: LoraMapping) -> torch.Tensor:
        from genserve.kernels import lora as lora_kernels

        return lora_kernels.lora_add(y, x, stack.a, stack.b, mapping.slots, stack.ranks)


class AutoBackend:
    """Triton for CUDA tensors when triton is importable, torch otherwise; decided per call from the first input."""

    name = "auto"

    def __init__(self) -> None:
        self._torch = TorchBackend()
        self._triton = TritonBackend() if importlib.util.find_spec("triton") is not None else None

    def _pick(self, t: torch.Tensor):
        # The kernels are forward-only: training on a GPU must keep autograd, so it takes the torch path.
        return self._triton if self._triton is not None and t.is_cuda and not _needs_grad(t) else self._torch

    def attend(self, q, k, v, *, causal: bool, sm_scale: float | None = None, window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return self._pick(q).attend(q, k, v, causal=causal, sm_scale=sm_scale, window=window, softcap=softcap,
                                    sinks=sinks)

    def paged_decode(self, q, k_cache, v_cache, block_tables, context_lens, *, sm_scale=None, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return self._pick(q).paged_decode(q, k_cache, v_cache, block_tables, context_lens, sm_scale=sm_scale,
                                          window=window, softcap=softcap, sinks=sinks)

    def mla_decode(self, q, cache, block_tables, context_lens, *, latent_dim: int, sm_scale=None,
                   window: int = 0) -> torch.Tensor:
        return self._pick(q).mla_decode(q, cache, block_tables, context_lens, latent_dim=latent_dim,
                                        sm_scale=sm_scale, window=window)

    def rms_norm(self, x, weight, eps: float, residual=None):
        return self._pick(x).rms_norm(x, weight, eps, residual)

    def apply_rope(self, q, k, cos, sin, positions, *, interleaved: bool = False):
        return self._pick(q).apply_rope(q, k, cos, sin, positions, interleaved=interleaved)

    def linear(self, x, weight, bias=None) -> torch.Tensor:
        return self._pick(x).linear(x, weight, bias)

    def quant_linear(self, x, blocks, qtype, bias=None) -> torch.Tensor:
        return self._pick(x).quant_linear(x, blocks, qtype, bias)

    def conv2d(self, x, weight, bias=None, *, stride, padding, prepared=None) -> torch.Tensor:
        return self._pick(x).conv2d(x, weight, bias, stride=stride, padding=padding, prepared=prepared)

    def group_norm(self, x, groups: int, weight=None, bias=None, eps: float = 1e-5, *, silu: bool = False):
        return self._pick(x).group_norm(x, groups, weight, bias, eps, silu=silu)

    def spatial_transformer(self, x, block, context) -> torch.Tensor | None:
        return self._pick(x).spatial_transformer(x, block, context)

    def experts(self, x, block, weights, idx) -> torch.Tensor | None:
        return self._pick(x).experts(x, block, weights, idx)

    def lora(self, y: torch.Tensor, x: torch.Tensor, stack: LoraStack, mapping: LoraMapping) -> torch.Tensor:
        return self._pick(x).lora(y, x, stack, mapping)


Backend = ReferenceBackend | TorchBackend | TritonBackend | AutoBackend

_FACTORIES = {"auto": AutoBackend, "reference": ReferenceBackend, "torch": TorchBackend, "triton": TritonBackend}


def get_backend(name: str | None = None) -> Backend:
    """A backend called `name`, else `$GENSERVE_BACKEND`, else "auto"; ValueError on an unknown name."""
    name = name or os.environ.get(ENV_VAR) or "auto"
    if name not in _FACTORIES:
        raise ValueError(f"unknown backend {name!r} (from argument or ${ENV_VAR}); expected one of {BACKEND_NAMES}")
    return _FACTORIES[name]()
