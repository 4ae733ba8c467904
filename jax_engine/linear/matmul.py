"""y = x W^T (times a scale per output feature for int8 weights): a C++ kernel for few rows (and with AVX-512 for
many rows of weights it reads in place), XLA's dot otherwise.

Weights are float32, bfloat16, float16, int8 (with a scale per output feature) or GGUF blocks (uint8 rows,
with each layer's block format named beside them: gguf_format.py).

Weights keep the checkpoint's [out, in] layout. A decode step of a small batch multiplies a handful of rows by
every weight of the model, so its cost is reading the weights from memory; XLA's CPU dot copies each weight
matrix into a blocked layout on every call before multiplying, about three times the memory traffic, and
padding the rows changes nothing. The few-rows kernel (cpu_kernel/few_rows_matmul.cc) streams each weight row
once for all rows. Past FEW_ROWS rows (more for narrower weights) the matmul is bound by arithmetic, not memory,
and XLA's dot is as fast, except where it must first copy or widen the weights: float32 layers of a stack and
every narrower weight (16-bit floats, int8, GGUF blocks) keep taking the kernel, which multiplies many rows in
register blocks and reads the weights in place (MANY_ROWS_KERNEL).
"""

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax_engine import native
from jax_engine.target_platform import platform
from jax_engine.linear.gguf_blocks import dequantize_layer
from jax_engine.linear.gguf_format import FORMATS

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "cpu_kernel" / "few_rows_matmul.cc"
_TARGET = "jax_engine_few_rows_matmul"
# Most rows the kernel takes, by bytes per weight: narrower weights stay memory-bound for more rows. A chain of
# SmolLM2's 30 layers of float32 matmuls and LM head on a 2-core Zen 4, kernel against XLA: 38/60 ms at 16 rows,
# 54/77 at 24, 71/105 at 32, 101/103 at 48, 130/129 at 64 (the first kernel, before its prefetch into L2, lost
# at 32 rows: 210 against 133). int8: 97 ms at 32 rows, where XLA would first widen every weight to float32.
FEW_ROWS = {4: 32, 2: 32, 1: 64}
# Past those rows, where the CPU has AVX-512, the kernel multiplies many rows in register blocks built for its 32
# registers (many_rows_features in few_rows_matmul.cc), reading the weights in place: a float32 layer of a stack,
# which XLA's dot would first copy out of the stack and repack, and narrower weights (16-bit floats, int8, GGUF
# blocks), which XLA's path first widens to a float32 copy two to eight times their size. Chains of SmolLM2's 30
# layers on a 2-core Xeon (AVX-512), XLA against the kernel, ms at 64 / 128 / 256 / 1024 rows: float32 q/k/v 15.4 /
# 23.0 / 47.8 / 130 against 11.8 / 18.5 / 41.3 / 123, MLP up 43.4 / 66.9 / 145 / 397 against 36.7 / 59.9 / 121 / 375,
# MLP down 26.0 / 38.2 / 80.8 / 228 against 14.2 / 28.3 / 69.9 / 219. A float32 LM head (one matrix, nothing to
# copy) came out even, so single float32 matrices keep XLA's dot, unless some rows are padding, which only the
# kernel skips (live_rows: the LM head's row bucket; 256 rows with 164 live took 52 ms on a Zen 4, every row 75,
# XLA's dot 77). int8, the same chains at 128 / 256 rows: q/k/v 26.9 / 43.4 against 20.9 / 37.8, MLP down 47.7 /
# 78.0 against 33.4 / 73.4, the LM head 33.0 / 72.1 against 29.0 / 67.4; random Q4_1 blocks: q/k/v 31.1 / 48.7
# against 18.6 / 35.3, the LM head 74.9 / 102.0 against 32.8 / 66.0.
MANY_ROWS_KERNEL = "avx512f" in native.cpu_signature().split()
# GGUF blocks past 8 rows are dequantized a few output features at a time in the kernel (few_rows_matmul.cc), so the
# weights cross memory once in their blocks where XLA's path writes and reads them dequantized to float32. The
# shipped file's Q4_1 matrices of all 30 layers on a 2-core Zen 5, kernel against dequantize + XLA's dot: up 7.6 /
# 9.7 / 20.6 / 51 ms against 21.6 / 22.4 / 29.0 / 44.0 at 48 / 64 / 128 / 256 rows, down 8.8 / 10.6 / 30.5 / 66
# against 22.3 / 24.0 / 29.8 / 46.5. (Streamed, before the kernel dequantized, it lost from ~32 rows: 62/59 ms at
# 32, 120/68 at 64.) Those blocks took 8 features at a time; without AVX-512 GGUF still stops at 64 rows.
GGUF_FEW_ROWS = 64
INT16_MAX = np.float32(32767)


@functools.cache
def kernel_unavailable_reason() -> str | None:
    """Build (once per machine) and register the kernel. None when it is ready, else why it is not."""
    return native.register_kernel(_SOURCE, "FewRowsMatmul", _TARGET, logger)


def few_rows_matmul(x: jax.Array, w: jax.Array, scale: jax.Array | None = None,
                    layer: jax.Array | int = 0, formats: tuple[str, ...] | None = None,
                    live_rows: jax.Array | None = None) -> jax.Array:
    """x [M, K] float, w [N, K] or stacked [L, N, K] (float32, bfloat16, float16 or int8; or GGUF blocks, uint8
    [N, row bytes] / [L, N, row bytes] with `formats` naming each layer's block format), scale [N] / [L, N]
    (int8) or None -> [M, N] float32, with the `layer`-th matrix of a stack. With `live_rows` (a traced int32
    scalar) only x's first live_rows rows are multiplied; the others' outputs are zeros."""
    scale = jnp.zeros((0,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    types = jnp.asarray([FORMATS[f][2] for f in formats or ()], jnp.int32)  # llama.cpp's ggml_type ids
    live = jnp.zeros((0,), jnp.int32) if live_rows is None else jnp.asarray(live_rows, jnp.int32)
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[-2]), jnp.float32))
    return call(x.astype(jnp.float32), w, scale, types, jnp.asarray(layer, jnp.int32), live)


def uses_few_rows_kernel(rows: int, w: jax.Array, padded: bool = False) -> bool:
    """Whether `linear` runs the kernel for this many rows of x times w (on this platform); `padded`: some of
    the rows are padding, which the kernel skips and XLA's dot would multiply."""
    width_fits = w.dtype == jnp.uint8 or w.shape[-1] % (16 if w.dtype == jnp.int8 else 8) == 0  # blocks: always
    most = GGUF_FEW_ROWS if w.dtype == jnp.uint8 else FEW_ROWS.get(w.dtype.itemsize, 0)
    # Not a single float32 matrix, unless padded: for the LM head XLA's dot and the kernel came out even.
    any_rows = MANY_ROWS_KERNEL and (w.dtype != jnp.float32 or w.ndim == 3 or padded)
    return (rows <= most or any_rows) and width_fits and platform() == "cpu" and kernel_unavailable_reason() is None


def round_rows_to_int16(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (integers in [-32767, 32767] as float32, step per row [T, 1]), x ~= integers * step.

    int8 weights and GGUF blocks multiply x rounded this way, in the kernel (where it lets vpmaddwd do 16
    multiply-adds an instruction, see few_rows_matmul.cc) and here alike, so both paths compute the same sums.
    """
    peak = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    nonzero = peak > 0
    inverse = jnp.where(nonzero, INT16_MAX / jnp.where(nonzero, peak, 1.0), 1.0)
    return jnp.round(x * inverse), jnp.where(nonzero, peak / INT16_MAX, 1.0)


def linear(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, out_dtype=None,
           layer: jax.Array | None = None, formats: tuple[str, ...] | None = None,
           live_rows: jax.Array | None = None) -> jax.Array:
    """x [T, in] @ w[out, in].T -> [T, out], times `scale` per output feature when given (int8 weights).

    With `layer`, w [L, out, in] (and scale [L, out]) hold every layer's weights and w[layer] is used: the
    kernel reads it in place, XLA's dot slices it out. GGUF blocks (uint8) come with `formats`, each layer's
    block format (one for a single matrix). int8 weights and GGUF blocks multiply x rounded to 16 bits per row
    (round_rows_to_int16). The result has x's dtype unless `out_dtype` is given; the sums are
    float32 either way. `live_rows`: the rows past it are a step's padding, which the kernel skips (their
    outputs are then zeros) and XLA's dot computes anyway.
    """
    out_dtype = out_dtype or x.dtype
    if (w.dtype == jnp.uint8) != (formats is not None):
        raise ValueError(f"GGUF blocks (uint8 rows) and only they name their block formats: {w.dtype} weights "
                         f"with formats={formats}")
    if uses_few_rows_kernel(x.shape[0], w, padded=live_rows is not None):
        return few_rows_matmul(x, w, scale, 0 if layer is None else layer, formats, live_rows).astype(out_dtype)
    if layer is not None:
        w, scale = w[layer], None if scale is None else scale[layer]
    rounds_x = w.dtype in (jnp.int8, jnp.uint8)
    if formats is not None:
        w = dequantize_layer(w, formats, 0 if layer is None else layer, x.shape[-1])
    if rounds_x:
        x_int16, step = round_rows_to_int16(x)
        y = jnp.einsum("tk,nk->tn", x_int16, w.astype(jnp.float32), preferred_element_type=jnp.float32) * step
    else:
        y = jnp.einsum("tk,nk->tn", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y if scale is None else y * scale).astype(out_dtype)
