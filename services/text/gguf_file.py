"""A GGUF file's metadata and tensors, read with `struct` and one memory map (the layout of ggml's docs/gguf.md: a
header, key/value metadata, tensor infos, then the aligned tensor data).

gguf-py's GGUFReader builds a numpy view for every element of every metadata array: on SmolLM2's 49,152 tokens and
48,900 merges it took 4-9 s of each load on a 2-core EPYC. This reads the same metadata in a fraction of a second;
each tensor's `data` is the same view GGUFReader gives (numpy order, quantized rows as uint8 bytes), so
gguf.quants.dequantize and QuantLinear.from_gguf take it as they are.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct codes (little-endian); 8 is a string, 9 an array.
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# Unquantized tensor types, viewed as their own numpy type (every other type is bytes, a row of blocks at a time).
PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
         GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
         GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # ggml order: ne[0] (the contiguous dimension) first
    data: np.ndarray  # numpy order (ne[n-1], ..., ne[0]); quantized types: (..., bytes per row) uint8


class _Cursor:
    """Reads GGUF's little-endian values from a buffer, front to back."""

    def __init__(self, buffer: memoryview):
        self.buffer, self.offset = buffer, 0

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.buffer, self.offset)
        self.offset += struct.calcsize(code)
        return value

    def string(self) -> str:
        size = self.scalar("Q")
        text = bytes(self.buffer[self.offset:self.offset + size]).decode("utf-8")
        self.offset += size
        return text

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.scalar("I"), self.scalar("Q")
            if item in SCALARS and item != 7:  # numbers in one read, not one struct call each
                values = np.frombuffer(self.buffer, dtype=np.dtype("<" + SCALARS[item]), count=count,
                                       offset=self.offset)
                self.offset += values.nbytes
                return values.tolist()
            return [self.value(item) for _ in range(count)]
        if kind not in SCALARS:
            raise ValueError(f"GGUF value type {kind} is not one the format defines")
        return self.scalar(SCALARS[kind])


class GGUFFile:
    """One GGUF file (version 2 or 3), memory-mapped: `metadata` (key -> value) and `tensors` in file order."""

    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cursor = _Cursor(memoryview(self._map))
        if bytes(cursor.buffer[:4]) != MAGIC:
            raise ValueError(f"{Path(path).name} is not a GGUF file (no GGUF magic)")
        cursor.offset = 4
        version = cursor.scalar("I")
        if version not in (2, 3):
            raise ValueError(f"{Path(path).name}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_values = cursor.scalar("Q"), cursor.scalar("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_values):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name, n_dims = cursor.string(), cursor.scalar("I")
            dims = [cursor.scalar("Q") for _ in range(n_dims)]
            infos.append((name, dims, GGMLQuantizationType(cursor.scalar("I")), cursor.scalar("Q")))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cursor.offset // alignment) * alignment
        raw = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = [self._tensor(raw, start, *info) for info in infos]

    @staticmethod
    def _tensor(raw: np.ndarray, start: int, name: str, dims: list[int], kind: GGMLQuantizationType,
                offset: int) -> GGUFTensor:
        shape = tuple(reversed(dims))  # numpy order
        block, type_bytes = GGML_QUANT_SIZES[kind]
        n_bytes = int(np.prod(dims)) * type_bytes // block
        data = raw[start + offset:start + offset + n_bytes]
        if kind in PLAIN:
            data = data.view(PLAIN[kind]).reshape(shape)
        else:
            data = data.reshape(*shape[:-1], shape[-1] // block * type_bytes)
        return GGUFTensor(name, kind, np.array(dims, dtype=np.uint64), data)
