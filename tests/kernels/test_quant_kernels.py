"""The quantised-weight products (C on the CPU, Triton in the interpreter or on a GPU) against the gguf package's
dequantisation followed by a dense matmul: llama.cpp's Q8_0, Q4_0 and Q4_1 blocks, quantised by gguf itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from genserve.kernels.quant_matmul import quant_linear

QTYPES = ("Q8_0", "Q4_0", "Q4_1")


def _raw(qtype: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 blocks (n, row bytes), the fp32 weights gguf dequantises them to), on the default device."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = gguf_quantize(w, GGMLQuantizationType[qtype])
    ref = gguf_dequantize(raw, GGMLQuantizationType[qtype])
    return torch.from_numpy(raw).to(torch.get_default_device()), torch.from_numpy(ref.copy()).to(
        torch.get_default_device())


# ---- C (CPU) ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16, 40])  # the in-register tiles (8 rows), their tail, sgemm (> 16)
def test_cpu_quant_linear_matches_gguf_dequant_then_matmul(cpu_kernels, qtype, rows):
    from genserve.kernels import cpu_quant

    raw, w = (t.cpu() for t in _raw(qtype, 72, 160, seed=rows))
    x, bias = torch.randn(rows, 160, device="cpu"), torch.randn(72, device="cpu")
    assert cpu_quant.supports(x, raw)
    torch.testing.assert_close(cpu_quant.linear(x, raw, qtype, bias), F.linear(x, w, bias), atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(cpu_quant.linear(x[None], raw, GGMLQuantizationType[qtype]), F.linear(x, w)[None],
                               atol=3e-5, rtol=1e-5)
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(cpu_quant.linear(xb, raw, qtype), F.linear(xb.float(), w).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", QTYPES)
def test_cpu_dequantize_is_bit_exact_and_slices_rows(cpu_kernels, qtype):
    from genserve.kernels import cpu_quant

    raw, w = (t.cpu() for t in _raw(qtype, 30, 96, seed=7))
    assert torch.equal(cpu_quant.dequantize(raw, qtype, 96), w)
    assert torch.equal(cpu_quant.dequantize(raw, qtype, 96, slice(5, 17)), w[5:17])


def test_cpu_quant_linear_refuses_what_does_not_fit(cpu_kernels):
    from genserve.kernels import cpu_quant

    raw, _ = (t.cpu() for t in _raw("Q4_1", 8, 64, seed=0))
    with pytest.raises(ValueError, match="do not fit"):
        cpu_quant.linear(torch.randn(2, 96, device="cpu"), raw, "Q4_1")
    with pytest.raises(ValueError, match="Q6_K"):
        cpu_quant.linear(torch.randn(2, 64, device="cpu"), raw, GGMLQuantizationType.Q6_K)


# ---- Triton ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 40, 96), (19, 70, 160)])
def test_triton_quant_linear_matches_gguf_dequant_then_matmul(qtype, rows, n, k):
    raw, w = _raw(qtype, n, k, seed=rows + n)
    x, bias = torch.randn(rows, k), torch.randn(n)
    torch.testing.assert_close(quant_linear(x, raw, qtype, bias), F.linear(x, w, bias), atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_quant_linear_in_half_precision(dtype):
    raw, w = _raw("Q4_1", 64, 128, seed=5)
    x = torch.randn(3, 128).to(dtype)
    y = quant_linear(x, raw, GGMLQuantizationType.Q4_1)
    assert y.dtype == dtype
    expected = F.linear(x.float(), w)
    # the weights meet x in x's dtype (tensor cores); bf16 keeps 8 bits of mantissa
    assert ((y.float() - expected).abs().max() / expected.abs().max()).item() < (2e-2 if dtype == torch.bfloat16
                                                                                  else 2e-3)


def test_triton_quant_linear_refuses_what_does_not_fit():
    raw, _ = _raw("Q8_0", 8, 64, seed=0)
    with pytest.raises(ValueError, match="do not fit"):
        quant_linear(torch.randn(2, 32), raw, "Q8_0")
    with pytest.raises(ValueError, match="Q5_K"):
        quant_linear(torch.randn(2, 64), raw, GGMLQuantizationType.Q5_K)
