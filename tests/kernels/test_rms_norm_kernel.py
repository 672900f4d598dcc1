"""genserve.kernels.rms_norm (Definition 19, "Root Mean Square Layer Normalisation", of the chapter
"Deep Learning Building Blocks"; residual add fused) against the reference backend."""

from __future__ import annotations

import pytest
import torch

from genserve.kernels import rms_norm
from genserve.shared.blocks.backend import get_backend

# (atol, rtol): both sides round to the dtype; bf16 also meets the interpreter's truncating casts.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (4e-2, 2e-2)}
EPS = 1e-6


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("shape", [(3, 100), (2, 5, 256)], ids=["ragged-width", "batched"])
def test_rms_norm_matches_reference(shape, dtype) -> None:
    x = torch.randn(shape, dtype=dtype)
    w = torch.randn(shape[-1], dtype=dtype)
    out = rms_norm(x, w, EPS)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, get_backend("reference").rms_norm(x, w, EPS), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_rms_norm_fused_residual_matches_reference(dtype) -> None:
    x, residual = torch.randn(2, 7, 96, dtype=dtype), torch.randn(2, 7, 96, dtype=dtype)
    w = torch.randn(96, dtype=dtype)
    x_before, r_before = x.clone(), residual.clone()
    y, new_residual = rms_norm(x, w, EPS, residual=residual)
    ref_y, ref_residual = get_backend("reference").rms_norm(x, w, EPS, residual)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(new_residual, ref_residual, atol=atol, rtol=rtol)
    torch.testing.assert_close(y, ref_y, atol=atol, rtol=rtol)
    assert torch.equal(x, x_before) and torch.equal(residual, r_before), "inputs must not be modified"


def test_rms_norm_reads_strided_rows() -> None:
    x = torch.randn(6, 128)[::2]  # every other row: a row stride of 256
    w = torch.randn(128)
    torch.testing.assert_close(rms_norm(x, w, EPS), get_backend("reference").rms_norm(x, w, EPS))


def test_rms_norm_output_dtype_follows_weight_promotion() -> None:
    x, w = torch.randn(4, 64, dtype=torch.float16), torch.randn(64, dtype=torch.float32)
    out = rms_norm(x, w, EPS)
    ref = get_backend("reference").rms_norm(x, w, EPS)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_rms_norm_rejects_mismatched_weight() -> None:
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 64), torch.randn(32), EPS)
