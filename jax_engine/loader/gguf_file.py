"""A GGUF file's metadata and tensors, read in one pass over the mapped file.

gguf's own GGUFReader keeps every metadata value as NumPy parts (a 49k-token vocabulary and its 49k merges are
~147k part objects), which took ~3 s of the default model's start-up; this reads each value straight into its
Python value (strings, numbers, lists) and each tensor as a view of the mapping, with the same values as the
reader's `field.contents()` and `tensor.data` (tests/test_gguf_file.py compares them).

The layout (llama.cpp's docs/gguf.md): a header (magic, version, tensor count, key-value count), the key-values
(key, type, value), each tensor's info (name, dimensions fastest-first, type, offset), then the tensors' data
from the next `general.alignment` boundary.
"""

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

_SCALARS = {  # value type -> struct format and NumPy dtype (without byte order)
    GGUFValueType.UINT8: ("B", "u1"), GGUFValueType.INT8: ("b", "i1"),
    GGUFValueType.UINT16: ("H", "u2"), GGUFValueType.INT16: ("h", "i2"),
    GGUFValueType.UINT32: ("I", "u4"), GGUFValueType.INT32: ("i", "i4"),
    GGUFValueType.UINT64: ("Q", "u8"), GGUFValueType.INT64: ("q", "i8"),
    GGUFValueType.FLOAT32: ("f", "f4"), GGUFValueType.FLOAT64: ("d", "f8"),
    GGUFValueType.BOOL: ("?", "?"),
}
_ELEMENT_DTYPES = {  # tensor types stored element by element; the others are blocks of bytes
    GGMLQuantizationType.F16: "f2", GGMLQuantizationType.F32: "f4", GGMLQuantizationType.F64: "f8",
    GGMLQuantizationType.I8: "i1", GGMLQuantizationType.I16: "i2", GGMLQuantizationType.I32: "i4",
    GGMLQuantizationType.I64: "i8",
}
_VERSIONS = (2, 3)  # version 1 (2023) counted in 32 bits; llama.cpp reads it no more either
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: fastest-varying dimension first ([in, out] for a matrix)
    data: np.ndarray  # a view of the mapping: elements in NumPy's order, or uint8 [rows..., row bytes] for blocks


class GGUFFile:
    """`fields`: key -> value (str, int, float, bool, or a list of them); `tensors`: in the file's order."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._bytes = np.memmap(path, mode="r")
        self._view = memoryview(self._bytes)
        magic, version = struct.unpack_from("<II", self._view, 0)
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
        self._order = "<" if version & 0xFFFF else ">"  # a big-endian file's version reads byte-swapped here
        version = version if self._order == "<" else int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in _VERSIONS:
            raise ValueError(f"{path}: GGUF version {version} is not supported; supported: {list(_VERSIONS)}")
        self._offset = 8
        tensor_count, kv_count = self._scalar("Q"), self._scalar("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"{path}: metadata key {key!r} appears twice")
            self.fields[key] = self._value(GGUFValueType(self._scalar("I")))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment={alignment} is not a power of two")
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError(f"{path}: a tensor name appears twice")

    # ---------------------------------------------------------------- values
    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(self._order + fmt, self._view, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("Q")
        text = str(self._view[self._offset:self._offset + length], "utf-8")
        self._offset += length
        return text

    def _value(self, value_type: GGUFValueType):
        if value_type == GGUFValueType.STRING:
            return self._string()
        if value_type == GGUFValueType.ARRAY:
            return self._array(GGUFValueType(self._scalar("I")), self._scalar("Q"))
        return self._scalar(_SCALARS[value_type][0])

    def _array(self, item_type: GGUFValueType, count: int) -> list:
        if item_type == GGUFValueType.STRING:
            return self._strings(count)
        if item_type not in _SCALARS:  # nested arrays
            return [self._value(item_type) for _ in range(count)]
        dtype = np.dtype(self._order + _SCALARS[item_type][1])
        items = np.frombuffer(self._view, dtype, count, self._offset)
        self._offset += dtype.itemsize * count
        return items.tolist()

    def _strings(self, count: int) -> list[str]:
        """`count` strings, in a loop of locals: a vocabulary and its merges are ~100k of them."""
        view, offset, length_of = self._view, self._offset, struct.Struct(self._order + "Q").unpack_from
        strings = []
        for _ in range(count):
            (length,) = length_of(view, offset)
            strings.append(str(view[offset + 8:offset + 8 + length], "utf-8"))
            offset += 8 + length
        self._offset = offset
        return strings

    # ---------------------------------------------------------------- tensors
    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        shape = tuple(self._scalar("Q") for _ in range(self._scalar("I")))
        return name, shape, GGMLQuantizationType(self._scalar("I")), self._scalar("Q")

    def _tensor(self, data_start: int, name: str, shape: tuple[int, ...], tensor_type: GGMLQuantizationType,
                offset: int) -> GGUFTensor:
        numpy_shape = tuple(reversed(shape))
        elements = int(np.prod(shape))
        if tensor_type in _ELEMENT_DTYPES:
            dtype = np.dtype(self._order + _ELEMENT_DTYPES[tensor_type])
            data = np.frombuffer(self._bytes, dtype, elements, data_start + offset).reshape(numpy_shape)
        else:
            block_size, block_bytes = GGML_QUANT_SIZES[tensor_type]
            if shape[0] % block_size:
                raise ValueError(f"{self.path}: tensor {name!r} rows of {shape[0]} are not whole {block_size}-blocks")
            row_bytes = shape[0] // block_size * block_bytes
            data = np.frombuffer(self._bytes, np.uint8, elements // block_size * block_bytes, data_start + offset)
            data = data.reshape(*numpy_shape[:-1], row_bytes)
        return GGUFTensor(name, tensor_type, shape, data)
