"""GGUF's block formats kept as the file stores them (quantization="gguf"): their layout, in NumPy.

Blocks of 32 weights, each with a float16 scale d (Q4_1 also a float16 minimum m):
    Q8_0  w = d q, q int8                      Q4_0  w = d (q - 8), q in 0..15
    Q4_1  w = d q + m                          Q5_0  w = d (q - 16), q in 0..31, fifth bits in 4 bytes after d
A 4-bit block packs weight j in the low nibble of byte j and weight j + 16 in its high nibble.

K-quants: super-blocks of 256 weights in 8 sub-blocks of 32 (Q6_K: 16 of 16), each sub-block with its own
small integer scale (and minimum), times the super-block's float16 d (and dmin):
    Q4_K  w = d sc_j q - dmin m_j, q in 0..15, sc_j and m_j 6 bits each (12 bytes for all 8)
    Q5_K  the same with q in 0..31, each weight's fifth bit in 32 bytes (bit j: sub-block j)
    Q6_K  w = d sc_i (q - 32), q in 0..63, sc_i int8 per 16 weights, d stored last
Their bytes are in the order llama.cpp's ggml-common.h lays them out (see the dequantizers in gguf_blocks.py).

The engine keeps a matrix as its raw bytes, uint8 [out, row bytes], and the format by name beside it (a row
of Q4_K has the same bytes as one of Q4_0, 144 per 256 against 18 per 32, so the width cannot tell them
apart). A stack of layers whose formats differ (a Q4_K_M file's ffn_down is Q6_K in some layers) keeps every
layer's own blocks in rows as wide as the widest, with each layer's format. The shipped SmolLM2 file is Q4_1
(layers) and Q8_0 (the embedding, which is also the LM head): 97 MB a token against 538 MB in float32.
"""

from typing import NamedTuple

import numpy as np

BLOCK = 32  # weights per block; a K-quant's sub-block
# format -> (weights per block, bytes per block, llama.cpp's ggml_type id, which the C++ kernel is given)
FORMATS = {"q4_0": (32, 18, 2), "q4_1": (32, 20, 3), "q5_0": (32, 22, 6), "q8_0": (32, 34, 8),
           "q4_k": (256, 144, 12), "q5_k": (256, 176, 13), "q6_k": (256, 210, 14)}


class BlockRows(NamedTuple):
    """A matrix as a GGUF file stores it: its block format and its raw rows, uint8 [out, row bytes]."""
    format: str
    rows: np.ndarray


def row_bytes(fmt: str, in_features: int) -> int:
    """The bytes of a row of `in_features` weights in format `fmt`."""
    weights, size, _ = FORMATS[fmt]
    if in_features % weights:
        raise ValueError(f"a {fmt} row holds a multiple of {weights} weights, not {in_features}")
    return in_features // weights * size


def check_rows(raw, fmt: str, in_features: int) -> None:
    """Raise unless `raw` (uint8 [..., width]) can hold rows of `in_features` weights in `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown GGUF block format {fmt!r}; kept ones: {sorted(FORMATS)}")
    if raw.dtype != np.uint8 or raw.shape[-1] < row_bytes(fmt, in_features):
        raise ValueError(f"{raw.dtype} rows of {raw.shape[-1]} bytes cannot hold {in_features} weights in {fmt} "
                         f"({row_bytes(fmt, in_features)} bytes)")


def as_q8_0(raw: np.ndarray, fmt: str, in_features: int) -> np.ndarray:
    """Q4_0 or Q5_0 rows (NumPy uint8) as the Q8_0 rows of the same weights, exactly: the same d, and q - 8 or
    q - 16 fit an int8. A matrix fused from tensors of these formats (Gemma 3's q and k in Q5_0, v in Q8_0) is
    then kept as one, in Q8_0."""
    if fmt == "q8_0":
        return raw
    if fmt not in ("q4_0", "q5_0"):
        raise ValueError(f"{fmt} blocks are no Q8_0 blocks (a minimum or another block size)")
    blocks = raw.reshape(*raw.shape[:-1], in_features // BLOCK, FORMATS[fmt][1])
    packed = blocks[..., -16:]
    q = np.concatenate([packed & 0xF, packed >> 4], axis=-1).astype(np.int16)
    if fmt == "q5_0":
        q += 16 * np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")
    q -= 8 if fmt == "q4_0" else 16
    out = np.concatenate([blocks[..., :2], q.astype(np.int8).view(np.uint8)], axis=-1)
    return out.reshape(*raw.shape[:-1], row_bytes("q8_0", in_features))
