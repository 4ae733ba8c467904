"""GGUF's block formats dequantized in JAX: raw rows (gguf_format.py lays them out) to float32 weights, inside
the jitted step (the matmul's fallback, matmul.py) and at start-up (quantization.dequantize).
"""

import functools

import jax
import jax.numpy as jnp

from jax_engine.linear.gguf_format import BLOCK, FORMATS, check_rows, row_bytes


def _float16(two_bytes: jax.Array) -> jax.Array:
    """uint8 [..., 2] (little-endian float16) -> float32 [...]."""
    return jax.lax.bitcast_convert_type(two_bytes, jnp.float16).astype(jnp.float32)


def _shifted(packed: jax.Array, shifts: tuple[int, ...], mask: int) -> jax.Array:
    """uint8 [..., n] -> [..., len(shifts), n]: (packed >> s) & mask for each shift s."""
    return (packed[..., None, :] >> jnp.asarray(shifts, jnp.uint8)[:, None]) & mask


def _nibbles(packed: jax.Array) -> jax.Array:
    """uint8 [..., 16] -> the block's 32 4-bit values in order, float32 [..., 32]."""
    return _shifted(packed, (0, 4), 0xF).reshape(*packed.shape[:-1], 32).astype(jnp.float32)


def _blocks_of_32(fmt: str, blocks: jax.Array) -> jax.Array:
    """uint8 [..., blocks, bytes] -> float32 [..., blocks, 32]."""
    d = _float16(blocks[..., 0:2])[..., None]
    if fmt == "q8_0":
        return d * jax.lax.bitcast_convert_type(blocks[..., 2:], jnp.int8).astype(jnp.float32)
    if fmt == "q4_0":
        return d * (_nibbles(blocks[..., 2:]) - 8.0)
    if fmt == "q5_0":
        fifth = jnp.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little").astype(jnp.float32)  # bit j: weight j
        return d * (_nibbles(blocks[..., 6:]) + 16.0 * fifth - 16.0)
    return d * _nibbles(blocks[..., 4:]) + _float16(blocks[..., 2:4])[..., None]  # q4_1


def _k_scales(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K / Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and minimums, each [..., 8] (gguf-py's unpacking:
    bytes 0-3 hold scales 0-3 and the top bits of scales 4-7, 4-7 the minimums alike, 8-11 their low bits)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = jnp.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(jnp.float32), mins.astype(jnp.float32)


def _k_quant(fmt: str, blocks: jax.Array) -> jax.Array:
    """uint8 [..., blocks, bytes] -> float32 [..., blocks, 256], with gguf-py's arithmetic step for step."""
    lead = blocks.shape[:-1]
    if fmt == "q6_k":
        low = _shifted(blocks[..., 0:128].reshape(*lead, 2, 64), (0, 4), 0xF).reshape(*lead, 8, 32)
        high = _shifted(blocks[..., 128:192].reshape(*lead, 2, 32), (0, 2, 4, 6), 0x3).reshape(*lead, 8, 32)
        q = ((low | (high << 4)).astype(jnp.int8) - 32).reshape(*lead, 16, 16).astype(jnp.float32)
        sc = jax.lax.bitcast_convert_type(blocks[..., 192:208], jnp.int8).astype(jnp.float32)
        return ((_float16(blocks[..., 208:210])[..., None] * sc)[..., None] * q).reshape(*lead, 256)
    sc, mins = _k_scales(blocks[..., 4:16])
    packed = blocks[..., -128:].reshape(*lead, 4, 32)
    q = _shifted(packed, (0, 4), 0xF).reshape(*lead, 8, 32)
    if fmt == "q5_k":
        q = q | (_shifted(blocks[..., 16:48], tuple(range(8)), 0x1) << 4)
    scale = (_float16(blocks[..., 0:2])[..., None] * sc)[..., None]
    minimum = (_float16(blocks[..., 2:4])[..., None] * mins)[..., None]
    return (scale * q.astype(jnp.float32) - minimum).reshape(*lead, 256)


def dequantize_blocks(raw: jax.Array, fmt: str, in_features: int) -> jax.Array:
    """Raw rows uint8 [..., width] in format `fmt` -> the float32 weights [..., in_features] they stand for
    (bytes past a row's own, where a mixed stack widened it, are not read)."""
    check_rows(raw, fmt, in_features)
    weights, size, _ = FORMATS[fmt]
    blocks = raw[..., :row_bytes(fmt, in_features)].reshape(*raw.shape[:-1], in_features // weights, size)
    w = _blocks_of_32(fmt, blocks) if weights == BLOCK else _k_quant(fmt, blocks)
    return w.reshape(*raw.shape[:-1], in_features)


def dequantize_layer(raw: jax.Array, formats: tuple[str, ...], layer, in_features: int) -> jax.Array:
    """A matrix of a stack whose layers have `formats`: the `layer`-th's (traced) rows raw -> float32. Layers of
    one format dequantize as that; layers of several take a branch per format (lax.switch)."""
    kinds = sorted(set(formats))
    if len(kinds) == 1:
        return dequantize_blocks(raw, kinds[0], in_features)
    index = jnp.asarray([kinds.index(f) for f in formats], jnp.int32)[layer]
    branches = [functools.partial(dequantize_blocks, fmt=k, in_features=in_features) for k in kinds]
    return jax.lax.switch(index, branches, raw)
