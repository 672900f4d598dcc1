"""The compiled kernels on a real GPU, at production-like sizes, against the references (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from genserve.kernels import apply_rope, flash_attention, paged_decode_attention, rms_norm
from genserve.shared.blocks.backend import get_backend
from genserve.shared.blocks.masks import causal_mask
from genserve.shared.blocks.rope import apply_rope as reference_rope
from genserve.shared.blocks.rope import rope_cos_sin
from genserve.shared.blocks.sdpa import scaled_dot_product_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Compiled kernels round like torch does, so these are tighter than the interpreter's.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda"


def _max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("hq", "hkv", "nq", "nk", "d"), [(16, 16, 1000, 1000, 64), (32, 8, 777, 2048, 128),
                                                            (8, 1, 2048, 2048, 128)])
def test_flash_attention_on_gpu(hq, hkv, nq, nk, d, causal, dtype) -> None:
    q = torch.randn(2, hq, nq, d, device=DEVICE, dtype=dtype)
    k = torch.randn(2, hkv, nk, d, device=DEVICE, dtype=dtype)
    v = torch.randn(2, hkv, nk, d, device=DEVICE, dtype=dtype)
    out = flash_attention(q, k, v, causal=causal)
    mask = causal_mask(nq, nk, DEVICE) if causal else None
    ref = scaled_dot_product_attention(q.float(), k.float(), v.float(), mask)
    assert _max_err(out, ref) <= TOLERANCES[dtype]


def test_flash_attention_varlen_on_gpu() -> None:
    lens = [1, 300, 1500, 77]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(lens), 16, 128, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(sum(lens), 4, 128, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = flash_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens))
    for i, n in enumerate(lens):
        s = slice(int(cu[i]), int(cu[i + 1]))
        q_i, k_i, v_i = (t[s].float().transpose(0, 1)[None] for t in (q, k, v))
        ref = scaled_dot_product_attention(q_i, k_i, v_i, causal_mask(n, n, DEVICE))[0].transpose(0, 1)
        assert _max_err(out[s], ref) <= TOLERANCES[torch.bfloat16], f"sequence {i}"


@pytest.mark.parametrize("num_splits", [None, 1], ids=["auto-split", "single"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_paged_decode_on_gpu(dtype, num_splits) -> None:
    block_size, num_blocks, hq, hkv, d = 16, 4096, 32, 8, 128
    lens = [9000, 1, 4097, 16]
    k_cache = torch.randn(num_blocks, block_size, hkv, d, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    max_blocks = max(lens) // block_size + 1
    tables = torch.randperm(num_blocks, device=DEVICE)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    tables = tables.to(torch.int32)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), hq, d, device=DEVICE, dtype=dtype)
    out = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, num_splits=num_splits)
    ref = get_backend("reference").paged_decode(q.float(), k_cache.float(), v_cache.float(), tables, context_lens)
    assert _max_err(out, ref) <= TOLERANCES[dtype]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_on_gpu(residual) -> None:
    x = torch.randn(4096, 4096, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(4096, device=DEVICE, dtype=torch.bfloat16)
    r = torch.randn_like(x) if residual else None
    out = rms_norm(x, w, 1e-5, residual=r)
    ref = get_backend("reference").rms_norm(x, w, 1e-5, r)
    for o, e in zip(out if residual else (out,), ref if residual else (ref,), strict=True):
        torch.testing.assert_close(o, e, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
def test_rope_on_gpu(interleaved) -> None:
    q = torch.randn(4, 512, 32, 128, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(4, 512, 8, 128, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = (t.to(DEVICE) for t in rope_cos_sin(128, 4096))
    positions = torch.randint(0, 4096, (4, 512), device=DEVICE)
    ref_q, ref_k = reference_rope(q.float(), k.float(), cos, sin, positions, interleaved)
    out_q, out_k = apply_rope(q, k, cos, sin, positions, interleaved=interleaved)
    assert _max_err(out_q, ref_q) <= TOLERANCES[torch.bfloat16] and _max_err(out_k, ref_k) <= TOLERANCES[torch.bfloat16]
