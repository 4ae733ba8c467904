"""GGUF's block formats kept as the file stores them (quantization="gguf"): Q8_0, Q4_0, Q4_1 and Q5_0.

A weight row of K inputs is K/32 blocks of 32 weights, each block with a float16 scale d (Q4_1 also a
float16 minimum m): Q8_0 w = d * q, q int8; Q4_0 w = d * (q - 8), q in 0..15; Q4_1 w = d * q + m; Q5_0
w = d * (q - 16), q in 0..31, its fifth bits in 4 bytes after d (bit j for weight j). A 4-bit block packs
weight j in the low nibble of byte j and weight j + 16 in its high nibble. The engine keeps a matrix as its raw
bytes, uint8 [out, K/32 x bytes per block]; the bytes per block (34, 18, 20, 22) tell the format, so a stored
weight needs no other tag. The shipped SmolLM2 file is Q4_1 (layers) and Q8_0 (the
embedding, which is also the LM head): 97 MB a token against 538 MB in float32.
"""

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
BYTES_PER_BLOCK = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22}


def block_format(row_bytes: int, in_features: int) -> str:
    """The format of a row of `row_bytes` bytes that stands for `in_features` weights."""
    for name, size in BYTES_PER_BLOCK.items():
        if in_features % BLOCK == 0 and row_bytes == in_features // BLOCK * size:
            return name
    raise ValueError(f"a row of {row_bytes} bytes is no GGUF block format of {in_features} weights "
                     f"(Q8_0, Q4_0, Q4_1 or Q5_0: 34, 18, 20 or 22 bytes per 32)")


def as_q8_0(raw: np.ndarray, in_features: int) -> np.ndarray:
    """Q4_0 or Q5_0 rows (NumPy uint8) as the Q8_0 rows of the same weights, exactly: the same d, and q - 8 or
    q - 16 fit an int8. A matrix fused from tensors of these formats (Gemma 3's q and k in Q5_0, v in Q8_0) is
    then kept as one, in Q8_0."""
    fmt = block_format(raw.shape[-1], in_features)
    if fmt == "q8_0":
        return raw
    if fmt not in ("q4_0", "q5_0"):
        raise ValueError(f"{fmt} blocks are no Q8_0 blocks (a minimum or another block size)")
    blocks = raw.reshape(*raw.shape[:-1], in_features // BLOCK, BYTES_PER_BLOCK[fmt])
    packed = blocks[..., -16:]
    q = np.concatenate([packed & 0xF, packed >> 4], axis=-1).astype(np.int16)
    if fmt == "q5_0":
        q += 16 * np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")
    q -= 8 if fmt == "q4_0" else 16
    out = np.concatenate([blocks[..., :2], q.astype(np.int8).view(np.uint8)], axis=-1)
    return out.reshape(*raw.shape[:-1], in_features // BLOCK * BYTES_PER_BLOCK["q8_0"])


def _float16(two_bytes: jax.Array) -> jax.Array:
    """uint8 [..., 2] (little-endian float16) -> float32 [...]."""
    return jax.lax.bitcast_convert_type(two_bytes, jnp.float16).astype(jnp.float32)


def _nibbles(packed: jax.Array) -> jax.Array:
    """uint8 [..., 16] -> the block's 32 4-bit values in order, float32 [..., 32]."""
    return jnp.concatenate([packed & 0xF, packed >> 4], axis=-1).astype(jnp.float32)


def dequantize_blocks(raw: jax.Array, in_features: int) -> jax.Array:
    """Raw rows uint8 [..., row_bytes] -> the float32 weights [..., in_features] they stand for."""
    fmt = block_format(raw.shape[-1], in_features)
    blocks = raw.reshape(*raw.shape[:-1], in_features // BLOCK, BYTES_PER_BLOCK[fmt])
    d = _float16(blocks[..., 0:2])[..., None]
    if fmt == "q8_0":
        w = d * jax.lax.bitcast_convert_type(blocks[..., 2:], jnp.int8).astype(jnp.float32)
    elif fmt == "q4_0":
        w = d * (_nibbles(blocks[..., 2:]) - 8.0)
    elif fmt == "q5_0":
        fifth = jnp.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little").astype(jnp.float32)  # bit j: weight j
        w = d * (_nibbles(blocks[..., 6:]) + 16.0 * fifth - 16.0)
    else:
        w = d * _nibbles(blocks[..., 4:]) + _float16(blocks[..., 2:4])[..., None]
    return w.reshape(*raw.shape[:-1], in_features)
