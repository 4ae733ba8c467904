"""Weight-only quantization: how a checkpoint's float weights are stored for the engine's matmuls.

float32 stays the reference. "bf16" keeps each weight's top 16 bits (half the bytes, ~3 significant digits);
"int8" stores each output feature's row as int8 with one float32 scale (the row's largest magnitude / 127),
a quarter of the bytes; "gguf" keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0 blocks and K-quants as the file stores them
(gguf_format.py; the shipped SmolLM2 file reads 97 MB a token) and its other matrices in the engine's dtype.
Activations, the KV cache and the arithmetic keep the engine's dtype: a weight is widened as it is read,
except that int8 weights and GGUF blocks multiply x rounded to 16 bits per row (integer multiply-adds, see
matmul.round_rows_to_int16), ~1.5e-5 of the row's largest value. At small batch a decode step's time is the
time to read the weights (see matmul.py), so fewer bytes per weight is proportionally faster there.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.arg_choices import QUANTIZATIONS
from jax_engine.linear.gguf_blocks import dequantize_blocks


def quantize(w: np.ndarray, quantization: str | None, dtype) -> tuple[np.ndarray, np.ndarray | None]:
    """A float [out, in] matrix (or a stack of them, [L, out, in]) -> (stored weight, scale per row or None), on the
    host: start-up stacks a model's layers in their stored format (int8's stack copies a quarter of float32's)."""
    if quantization in (None, "gguf"):  # "gguf": a matrix the file has in no kept block format
        return np.asarray(w, dtype), None
    if quantization == "bf16":
        return np.asarray(w, jnp.bfloat16), None
    if quantization == "int8":
        return int8_rows(w)
    raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")


def int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 weights and a float32 scale per row (its largest magnitude / 127), in NumPy. Each pass over the matrix
    is one ufunc and the rounding runs in place: start-up quantizes the whole model, where temporaries for |w|,
    the rounded and the clipped matrix cost 2.5x the time (1.1 s of the default model's int8 start-up)."""
    w = np.asarray(w, np.float32)
    peak = np.maximum(w.max(axis=-1), -w.min(axis=-1))
    scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)  # an all-zero row keeps scale 1
    q = np.divide(w, scale[..., None])
    np.clip(np.rint(q, out=q), -127, 127, out=q)
    return q.astype(np.int8), scale


def dequantize(w: jax.Array, scale: jax.Array | None, dtype, in_features: int,
               block_format: str | None = None) -> jax.Array:
    """The float matrix a stored weight stands for (the embedding lookup reads rows of it); GGUF blocks name
    their `block_format`."""
    if block_format is not None:
        return dequantize_blocks(w, block_format, in_features).astype(dtype)
    return w.astype(dtype) if scale is None else (w.astype(jnp.float32) * scale[:, None]).astype(dtype)
