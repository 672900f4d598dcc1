"""The C kernels for the CPU (kernels/csrc) against torch on the same inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genserve.kernels import cpu_attention, cpu_gemv, cpu_group_norm, cpu_paged_decode
from genserve.shared.blocks.backend import ReferenceBackend, TorchBackend

pytestmark = pytest.mark.usefixtures("cpu_kernels")
CPU = torch.device("cpu")


def _randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, device=CPU).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 8])  # two chains of sums per row below 4 rows, one from 4 (gemv.c)
@pytest.mark.parametrize("k", [64, 37])
def test_gemv_matches_linear(dtype, rows, k):
    gen = torch.Generator().manual_seed(rows * 100 + k)
    x, w, b = _randn(rows, k, gen=gen), _randn(48, k, gen=gen, dtype=dtype), _randn(48, gen=gen)
    assert cpu_gemv.supports(x, w)
    torch.testing.assert_close(cpu_gemv.gemv(x, w, b), F.linear(x, w.float(), b), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cpu_gemv.gemv(x[:, None], w), F.linear(x[:, None], w.float()), atol=1e-4, rtol=1e-5)


def test_gemv_refuses_more_rows_than_it_tiles():
    gen = torch.Generator().manual_seed(0)
    x, w = _randn(cpu_gemv.MAX_ROWS + 1, 16, gen=gen), _randn(8, 16, gen=gen)
    assert not cpu_gemv.supports(x, w)
    with pytest.raises(ValueError, match="rows"):
        cpu_gemv.gemv(x, w)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_gemv.gemv(x[:2], _randn(8, 15, gen=gen))


def test_torch_backend_linear_uses_the_kernel_only_without_grad():
    gen = torch.Generator().manual_seed(1)
    x = _randn(2, 32, gen=gen)
    w = _randn(16, 32, gen=gen).requires_grad_()
    y = TorchBackend().linear(x, w)  # gradients needed: F.linear, with autograd
    y.sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(16, 32))
    with torch.no_grad():
        torch.testing.assert_close(TorchBackend().linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_the_written_out_attention(dtype):
    gen = torch.Generator().manual_seed(2)
    num_blocks, block_size, hkv, d, batch, hq = 40, 4, 2, 16, 3, 6
    k_cache = _randn(num_blocks, block_size, hkv, d, gen=gen, dtype=dtype)
    v_cache = _randn(num_blocks, block_size, hkv, d, gen=gen, dtype=dtype)
    q = _randn(batch, hq, d, gen=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * 8].view(batch, 8).to(torch.int32)
    lens = torch.tensor([1, 17, 32], dtype=torch.int32)
    assert cpu_paged_decode.supports(q, k_cache, v_cache)
    out = cpu_paged_decode.paged_decode(q, k_cache, v_cache, tables, lens, sm_scale=0.3)
    ref = ReferenceBackend().paged_decode(q, k_cache.float(), v_cache.float(), tables, lens, sm_scale=0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # a sequence with no context yet attends to nothing
    empty = cpu_paged_decode.paged_decode(q[:1], k_cache, v_cache, tables[:1], torch.zeros(1, dtype=torch.int32))
    assert torch.equal(empty, torch.zeros_like(empty))


@pytest.mark.parametrize(("shape", "groups"), [((2, 64, 8, 8), 32), ((2, 192, 4, 4), 32), ((3, 6, 5, 7), 3)])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("silu", [False, True])
def test_group_norm_matches_torch_in_both_layouts(shape, groups, channels_last, silu):
    gen = torch.Generator().manual_seed(shape[1])
    x = _randn(*shape, gen=gen) * 3 + 1.5  # off-centre, so a one-pass variance would lose digits
    w, b = _randn(shape[1], gen=gen), _randn(shape[1], gen=gen)
    inp = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    assert cpu_group_norm.supports(inp)
    out = cpu_group_norm.group_norm(inp, groups, w, b, 1e-6, silu=silu)
    expected = F.group_norm(x, groups, w, b, 1e-6)
    torch.testing.assert_close(out, F.silu(expected) if silu else expected, atol=1e-5, rtol=1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    no_affine = cpu_group_norm.group_norm(inp, groups, None, None, 1e-6)
    torch.testing.assert_close(no_affine, F.group_norm(x, groups, eps=1e-6), atol=1e-5, rtol=1e-5)


def test_group_norm_refuses_groups_that_do_not_divide_the_channels():
    with pytest.raises(ValueError, match="divide"):
        cpu_group_norm.group_norm(torch.randn(1, 6, 2, 2), 4, None, None, 1e-5)
    assert not cpu_group_norm.supports(torch.randn(1, 6, 2, 2).transpose(2, 3))  # neither layout
    assert not cpu_group_norm.supports(torch.randn(1, 6, 2, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize("batch, heads, kv_heads, tq, tk, d", [
    (2, 4, 4, 70, 70, 16),  # a DiT's joint attention, tails of both tiles
    (1, 6, 2, 13, 29, 8),  # GQA
    (1, 2, 2, 37, 5, 32),
    (2, 3, 1, 9, 17, 24),
    (1, 2, 2, 1, 1, 32),
])
def test_attention_matches_sdpa_on_strided_inputs(batch, heads, kv_heads, tq, tk, d):
    gen = torch.Generator().manual_seed(tq * 7 + tk)
    # (B, T, H, D) storage seen as (B, H, T, D), as a projection's output is; k contiguous
    q = _randn(batch, tq, heads, d, gen=gen).transpose(1, 2)
    k = _randn(batch, kv_heads, tk, d, gen=gen)
    v = _randn(batch, tk, kv_heads, d, gen=gen).transpose(1, 2)
    assert cpu_attention.supports(q, k, v)
    out = cpu_attention.attention(q, k, v, sm_scale=0.3)
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=heads != kv_heads)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    assert out.transpose(1, 2).is_contiguous()  # (B, T, H, D): the output projection's rows without a copy


def test_attention_is_for_fp32_head_sizes_it_vectorises_without_autograd():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (_randn(1, 2, 8, 16, gen=gen) for _ in range(3))
    assert cpu_attention.supports(q, k, v)
    odd = _randn(1, 2, 8, 12, gen=gen)
    wide = _randn(1, 2, 8, 64, gen=gen)
    assert not cpu_attention.supports(odd, odd, odd) and not cpu_attention.supports(wide, wide, wide)
    assert not cpu_attention.supports(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert not cpu_attention.supports(q.requires_grad_(), k, v)


def test_torch_backend_routes_bidirectional_cpu_attention_to_the_kernel(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (_randn(2, 4, 40, 16, gen=gen) for _ in range(3))
    calls = []
    kernel = cpu_attention.attention
    monkeypatch.setattr(cpu_attention, "attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    backend = TorchBackend()
    with torch.no_grad():
        out = backend.attend(q, k, v, causal=False, sm_scale=0.25)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.25), atol=2e-6, rtol=1e-5)
        assert calls == [1]
        backend.attend(q, k, v, causal=True)  # masks stay with SDPA
        backend.attend(q, k, v, causal=True, window=8)
        wide = _randn(2, 4, 40, 64, gen=gen)
        backend.attend(wide, wide, wide, causal=False)  # heads past 32: SDPA is faster
    assert calls == [1]
