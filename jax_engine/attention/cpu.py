"""The CPU backend: paged attention by a C++ kernel that reads the paged cache in place, ragged.

XLA can only attend over a paged cache by gathering each sequence's blocks into a dense copy first, with
every context padded to the longest and every prefill chunk to the longest chunk; on a CPU that copy and
that padding, not the arithmetic, are most of the attention's cost. The kernel
(cpu_kernel/paged_attention.cc) takes the step's tokens as they are laid out, one query row each, and
reads each row's keys and values through its sequence's block table up to the row's own position:
decode and prefill tokens alike, causal by construction, nothing padded. With a sliding window a row reads
only the blocks its window reaches.

The kernel is compiled with the system C++ compiler on first use (jax_engine/native.py); without a
compiler the "auto" backend falls back to "xla" (and says why in the log).
"""

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine import native
from jax_engine.attention import xla
from jax_engine.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "cpu_kernel" / "paged_attention.cc"
_TARGET = "jax_engine_paged_attention"
_WRITE_SOURCE = Path(__file__).parent / "cpu_kernel" / "write_kv.cc"
_WRITE_TARGET = "jax_engine_write_kv"


@functools.cache
def kernel_unavailable_reason() -> str | None:
    """Build (once per machine) and register the kernels. None when they are ready, else why they are not."""
    return (native.register_kernel(_SOURCE, "PagedAttention", _TARGET, logger)
            or native.register_kernel(_WRITE_SOURCE, "WriteKV", _WRITE_TARGET, logger))


def write_kv(k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """xla.write_kv's contract. A 16- or 8-bit cache is written in place by the write_kv kernel
    (cpu_kernel/write_kv.cc), the step's rows rounded by XLA first: XLA:CPU would widen the whole cache to
    float32 to scatter into it."""
    if jnp.dtype(k_cache.dtype).itemsize == 4:
        return xla.write_kv(k, v, k_cache, v_cache, layer, slot_mapping)
    caches = (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    call = jax.ffi.ffi_call(_WRITE_TARGET, caches, input_output_aliases={2: 0, 3: 1})
    return call(xla.to_cache_dtype(k, k_cache.dtype), xla.to_cache_dtype(v, v_cache.dtype), k_cache, v_cache,
                jnp.asarray(layer, jnp.int32), slot_mapping.astype(jnp.int32))


def attend_rows(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, tables: jax.Array,
                query_seq: jax.Array, context_lens: jax.Array, block_size: int, scale: float, *,
                sliding_window: int | None = None, alibi_slopes: jax.Array | None = None,
                logits_soft_cap: float | None = None) -> jax.Array:
    """q [R, N, D] -> [R, N, D]: each query row over the first context_lens[r] keys of sequence query_seq[r].

    Rows with context_len 0 are padding (zeros out). Caches may be float32, bfloat16, float16, float8_e4m3fn or
    float8_e5m2.

    Args:
        q: [R, N, D] query rows; row r sits at position context_lens[r] - 1 of its sequence.
        k_cache: [L, num_slots, K, D] every layer's keys; v_cache: the same for values.
        layer: the layer to read.
        tables: [B, C] int32 block ids of each sequence.
        query_seq: [R] int32 the sequence (row of tables) of each query row.
        context_lens: [R] int32 keys each row sees (0: padding row).
        block_size: tokens per block.
        scale: softmax scale.
        sliding_window: each row sees only its last `sliding_window` keys, and reads only their blocks
            (None: all its keys); an int, or a traced int32 scalar (a model whose layers differ: Gemma 3).
        alibi_slopes: [N] float32 ALiBi slope of each query head: slope * (t - p) is added to the scaled
            score of key t for the row at position p (None: no ALiBi).
        logits_soft_cap: scaled scores become cap * tanh(score / cap), before ALiBi (None: uncapped).

    Returns:
        [R, N, D] float32 attention outputs.
    """
    if isinstance(sliding_window, int) and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 (or None), got {sliding_window}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive (or None), got {logits_soft_cap}")
    # The kernel takes a slopes buffer either way: all zeros is no ALiBi (and it skips the term).
    slopes = jnp.zeros(q.shape[1], jnp.float32) if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32)
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)  # 0: none
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k_cache, v_cache, jnp.asarray(layer, jnp.int32), window, tables, query_seq,
                context_lens, slopes, block_size=np.int64(block_size), scale=np.float32(scale),
                logits_soft_cap=np.float32(logits_soft_cap or 0.0))


def _rows(metadata: AttentionMetadata, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(sequence, context length) of each token row: a token at position p sees keys 0..p."""
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    starts = metadata.query_start_loc
    # The last sequence starting at or before each token (empty padding sequences share their start).
    seq = jnp.searchsorted(starts, tokens, side="right").astype(jnp.int32) - 1
    real = tokens < starts[-1]
    return jnp.where(real, seq, 0), jnp.where(real, metadata.positions + 1, 0)


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    layer: jax.Array, metadata: AttentionMetadata, block_size: int, scale: float, *,
                    sliding_window: int | None = None, alibi_slopes: jax.Array | None = None,
                    logits_soft_cap: float | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention backend contract (see metadata.py), on the ragged layout: decode_token_index and
    prefill_token_index are not read (the model runner leaves them empty for this backend)."""
    k_cache, v_cache = write_kv(k, v, k_cache, v_cache, layer, metadata.slot_mapping)
    query_seq, context_lens = _rows(metadata, q.shape[0])
    out = attend_rows(q, k_cache, v_cache, layer, metadata.block_tables, query_seq, context_lens, block_size, scale,
                      sliding_window=sliding_window, alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap)
    return out.astype(q.dtype), k_cache, v_cache
