"""QuantLinear and the GGUF block formats against the gguf package's own quantisers and dequantisers (llama.cpp's
layouts), on every backend, and through a GGUF file written and read back with gguf's writer and reader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from torch import nn

from genserve.kernels.quant_formats import dequantize, quant_format
from genserve.shared.blocks.backend import get_backend
from genserve.shared.blocks.quant_linear import QuantLinear

QTYPES = ("Q8_0", "Q4_0", "Q4_1")


def _raw(qtype: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """llama.cpp-quantised bytes of a random (n, k) matrix, and their dequantised fp32 weights per gguf."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = gguf_quantize(w, GGMLQuantizationType[qtype])
    return raw, torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[qtype]).copy())


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_is_bit_exact_with_gguf(qtype):
    raw, expected = _raw(qtype, 24, 160, seed=1)
    got = dequantize(torch.from_numpy(raw), qtype, 160)
    assert torch.equal(got, expected)
    assert torch.equal(dequantize(torch.from_numpy(raw), GGMLQuantizationType[qtype], 160), expected)  # by id


@pytest.mark.parametrize("backend", ["reference", "torch", "triton", "auto"])
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_quant_linear_is_the_dense_product_of_its_dequantised_weight(backend, qtype, rows):
    """Triton runs compiled on a GPU when there is one, else in the interpreter (tests/conftest.py)."""
    dev = "cuda" if backend in ("triton", "auto") and torch.cuda.is_available() else "cpu"
    raw, w = _raw(qtype, 48, 96, seed=rows)
    bias = torch.randn(48)
    layer = QuantLinear.from_gguf(GGMLQuantizationType[qtype], raw, (48, 96), bias, backend=get_backend(backend))
    assert layer.blocks.dtype == torch.uint8 and layer.blocks.shape == (48, 96 // 32 * quant_format(qtype).block_bytes)
    assert not any(t.is_floating_point() and t.numel() == 48 * 96 for t in layer.state_dict().values())
    x = torch.randn(2, rows, 96)
    with torch.no_grad():
        y = layer.to(dev)(x.to(dev)).cpu()
    torch.testing.assert_close(y, F.linear(x, w, bias), atol=2e-5, rtol=1e-5)
    assert torch.equal(layer.dequantized_weight().cpu(), w)


def test_from_linear_quantises_as_llama_cpp_and_select_rows_moves_whole_rows():
    dense = nn.Linear(64, 12)
    layer = QuantLinear.from_linear(dense, "q4_1")
    expected = gguf_dequantize(gguf_quantize(dense.weight.detach().numpy(), GGMLQuantizationType.Q4_1),
                               GGMLQuantizationType.Q4_1)
    assert layer.qtype == "Q4_1" and torch.equal(layer.dequantized_weight(), torch.from_numpy(expected))
    order = torch.randperm(12)
    picked = layer.select_rows(order)
    assert torch.equal(picked.dequantized_weight(), layer.dequantized_weight()[order])
    assert torch.equal(picked.bias, layer.bias[order])
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(picked(x), layer(x)[:, order])


def test_a_gguf_file_round_trip_gives_the_layer_of_its_tensor(tmp_path):
    """The byte layout and shape convention of a real file: written by gguf's writer, read by its reader."""
    raw, w = _raw("Q4_1", 40, 128, seed=3)
    writer = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = GGUFReader(str(tmp_path / "t.gguf")).tensors[0]
    assert tensor.tensor_type == GGMLQuantizationType.Q4_1 and tensor.shape.tolist() == [128, 40]  # GGUF: (in, out)
    layer = QuantLinear.from_gguf(tensor.tensor_type, tensor.data, tuple(int(s) for s in tensor.shape[::-1]))
    assert torch.equal(layer.dequantized_weight(), w)


def test_types_and_sizes_that_do_not_fit_are_refused_by_name():
    raw, _ = _raw("Q8_0", 4, 64, seed=0)
    with pytest.raises(ValueError, match="Q4_K"):
        QuantLinear.from_gguf(GGMLQuantizationType.Q4_K, raw, (4, 64))
    with pytest.raises(ValueError, match="needs 272 uint8 bytes"):
        QuantLinear.from_gguf("Q8_0", raw[:, :-1], (4, 64))
    with pytest.raises(ValueError, match="in_features=48"):
        QuantLinear(48, 4, "Q4_0")
