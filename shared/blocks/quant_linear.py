"""The affine map z = W a + b of Def. 1 ("Feedforward Neural Network", in the chapter "Deep Learning Building Blocks")
with W kept in a GGUF checkpoint's own quantised blocks (Q8_0, Q4_0, Q4_1; the layouts are in kernels/quant_formats.py),
for inference.

The module holds the file's bytes, never an fp32 copy: ``blocks`` is a uint8 buffer (out_features, row bytes),
one row of K / 32 blocks per output feature, and the backend's ``quant_linear`` dequantises inside the product (a
C kernel on the CPU, Triton on CUDA). ``QuantLinear.from_gguf`` is what a GGUF loader calls for such a tensor;
``from_linear`` quantises a dense layer the way llama.cpp does.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from genserve.kernels.quant_formats import dequantize, quant_format, row_bytes
from genserve.shared.blocks.backend import Backend, get_backend


class QuantLinear(nn.Module):
    """y = x W^T + b, x (..., in_features) -> (..., out_features), W (out_features, in_features) in ``qtype``."""

    def __init__(self, in_features: int, out_features: int, qtype: str | int, bias: bool = False,
                 backend: Backend | None = None):
        super().__init__()
        self.qtype = quant_format(qtype).name
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("blocks", torch.zeros(out_features, row_bytes(quant_format(qtype), in_features),
                                                   dtype=torch.uint8))  # (N, K / 32 * block bytes)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.backend = backend or get_backend()

    @classmethod
    def from_gguf(cls, qtype: str | int, data: np.ndarray | torch.Tensor, shape: tuple[int, int],
                  bias: torch.Tensor | None = None, backend: Backend | None = None) -> QuantLinear:
        """A layer over a GGUF tensor's raw bytes: ``qtype`` its type (``gguf.GGMLQuantizationType`` or a name),
        ``data`` its uint8 bytes (``GGUFTensor.data``: (out, row bytes), or flat), ``shape`` (out_features,
        in_features) as in nn.Linear (GGUF lists it reversed). The bytes are copied once, out of a memory map.
        ValueError naming the type or the size when they do not fit."""
        out_features, in_features = shape
        layer = cls(in_features, out_features, qtype, bias=bias is not None, backend=backend)
        size = data.size if isinstance(data, np.ndarray) else data.numel()
        if str(data.dtype).removeprefix("torch.") != "uint8" or size != layer.blocks.numel():
            raise ValueError(f"{layer.qtype} tensor of shape {tuple(shape)} needs {layer.blocks.numel()} uint8 "
                             f"bytes; got {data.dtype} {tuple(data.shape)}")
        if isinstance(data, np.ndarray):  # one copy, straight out of the reader's memory map
            np.copyto(layer.blocks.numpy(), data.reshape(layer.blocks.shape))
        else:
            layer.blocks.copy_(data.reshape(layer.blocks.shape))
        if bias is not None:
            layer.bias.data.copy_(bias.reshape(out_features))
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, qtype: str | int, backend: Backend | None = None) -> QuantLinear:
        """``linear`` quantised to ``qtype`` with llama.cpp's own rounding (gguf.quants.quantize), as a GGUF file
        of it would hold it."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        fmt = quant_format(qtype)
        raw = quantize(linear.weight.detach().float().cpu().numpy(), GGMLQuantizationType(fmt.ggml_type))
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls.from_gguf(fmt.ggml_type, raw, (linear.out_features, linear.in_features), bias, backend)

    def select_rows(self, index: torch.Tensor) -> QuantLinear:
        """The layer of output features ``index`` (a permutation, e.g. llama.cpp's Q/K row order undone, or a
        slice of a fused projection): whole rows of blocks move, nothing is re-quantised."""
        layer = QuantLinear(self.in_features, index.numel(), self.qtype, bias=self.bias is not None,
                            backend=self.backend)
        layer.blocks.copy_(self.blocks[index])
        if self.bias is not None:
            layer.bias.data.copy_(self.bias.detach()[index])
        return layer

    def dequantized_weight(self) -> torch.Tensor:
        """W as fp32 (out_features, in_features), for checks and for consumers that need a dense copy."""
        return dequantize(self.blocks, self.qtype, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.quant_linear(x, self.blocks, self.qtype, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}, " \
               f"bias={self.bias is not None}"
