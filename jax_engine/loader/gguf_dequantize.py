"""GGUF tensors dequantized to float32 at load: llama.cpp's legacy block formats with whole-tensor NumPy.

The gguf package dequantizes a tensor in groups of 16 rows, with a split, a shift and a concatenation per group:
0.88 s for the default model's Q4_1 matrices and 0.16 s for its Q8_0 embedding, the largest part of an int8 or
float32 start. The same arithmetic over the whole tensor at once, written into one output array, takes 0.35 s
and 0.03 s. Each gives the gguf package's bits exactly (tests/test_gguf_dequantize.py): the same float16 scales,
the same float32 products and sums, in the same order. Other formats go to the gguf package.

A block of 32 weights, as ggml-common.h lays it out:
    Q4_0: float16 d, 16 bytes of 4-bit q (low nibbles are weights 0-15, high nibbles 16-31); w = (q - 8) * d
    Q4_1: float16 d, float16 m, the same 16 bytes;                                          w = q * d + m
    Q8_0: float16 d, 32 int8 q;                                                              w = q * d
"""

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize


def _scale(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte `offset` of every block, as a float32 column."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] float32 values 0-15: low nibbles first, then high ones."""
    out = np.empty((packed.shape[0], 32), np.float32)
    np.bitwise_and(packed, 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(packed, 4, out=out[:, 16:], casting="unsafe")
    return out


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    out = _nibbles(blocks[:, 2:])
    out -= 8  # exact in float32, as the gguf package's int8 subtraction
    out *= _scale(blocks, 0)
    return out


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    out = _nibbles(blocks[:, 4:])
    out *= _scale(blocks, 0)
    out += _scale(blocks, 2)
    return out


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    out *= _scale(blocks, 0)
    return out


# format -> (bytes per block, dequantizer)
_WHOLE_TENSOR = {GGMLQuantizationType.Q4_0: (18, _q4_0), GGMLQuantizationType.Q4_1: (20, _q4_1),
                 GGMLQuantizationType.Q8_0: (34, _q8_0)}


def dequantize(data: np.ndarray, tensor_type: GGMLQuantizationType) -> np.ndarray:
    """A quantized tensor's raw bytes (as the gguf package reads them) -> its float32 weights, flat."""
    if tensor_type not in _WHOLE_TENSOR:
        return gguf_dequantize(data, tensor_type).reshape(-1)
    block_bytes, whole_tensor = _WHOLE_TENSOR[tensor_type]
    return whole_tensor(np.asarray(data).reshape(-1, block_bytes)).reshape(-1)
