"""Paged decode attention in Pallas (Triton lowering): one query token per sequence.

Grid: (sequence, KV head, context partition). Each program attends the query heads of one KV-head group
(GQA/MQA: all of them together, padded to 16 rows for the tensor cores) over one partition of the
sequence's blocks, keeping a running max and sum (online softmax). Partitions are merged afterwards with
a log-sum-exp reduction, vLLM's v2 / flash-decoding scheme, so a long context with a small batch still
spreads over the whole GPU. With a sliding window the partitions split only the blocks the window reaches
(the blocks before it are never read), so the window's work still spreads over all of them.

Cache layout is the engine's: [layers, num_blocks, block_size, num_kv_heads, head_dim]; the layer is an
argument, so no per-layer copy of the cache is made.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (MIN_ROWS, NEG, check_query_fits_cache, check_variant, load_blocks,
                                    online_softmax_step, pad_last_axis, padded_width, visible_and_bias, window_start)

# KV blocks a loop step loads (64 keys with the engine's 16-token blocks). Timed on an H100 in two GPU checks
# (docs/benchmarks.md#gpu-check): with the engine's 4 partitions, 4 beat 2 at all 8 shapes of the second, by
# 4-17% (batch 64, context 2048: 264 against 304 us), as at the 3 shapes of the first; 8 lost to 4 by up to 19%
# at 5 of the 8 and won by at most 4% at 3.
BLOCKS_PER_STEP = 4


def _decode_kernel(layer_ref, lens_ref, tables_ref, slopes_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
                   block_size: int, blocks_per_step: int, blocks_per_partition: int, scale: float,
                   sliding_window: int | None, alibi: bool, logits_soft_cap: float | None):
    # layer_ref [1]; lens_ref [1] (this sequence); tables_ref [C'] (this sequence's blocks, padded)
    # slopes_ref [M] (ALiBi slopes of this KV head's query group, padded; read only with alibi)
    # q_ref [M, W] (one KV head's query group, padded; W: head_dim padded); k_ref/v_ref [L, NB, bs, K, D]
    # (whole cache); o_ref [M, W], m_ref [M], l_ref [M]: this partition's unnormalised output, max and sum
    head, partition = pl.program_id(1), pl.program_id(2)
    layer, seq_len = layer_ref[0], lens_ref[0]
    q = q_ref[...].astype(jnp.float32)
    rows, padded_dim = q.shape
    keys_per_step = blocks_per_step * block_size
    # Partitions start at the window's first block, rounded down to a whole step (block 0 without a window).
    window_block = window_start(seq_len, sliding_window) // block_size
    first_block = window_block // blocks_per_step * blocks_per_step + partition * blocks_per_partition
    last_block = jnp.minimum(pl.cdiv(seq_len, block_size), first_block + blocks_per_partition)
    query_pos = jnp.full((rows,), seq_len - 1)
    slopes = slopes_ref[...] if alibi else None

    def body(i, carry):
        start = first_block + i * blocks_per_step
        ids = tables_ref[pl.ds(start, blocks_per_step)]
        k, v = (load_blocks(ref, layer, ids, head, padded_dim) for ref in (k_ref, v_ref))
        key_pos = start * block_size + jnp.arange(keys_per_step)
        visible, bias = visible_and_bias(query_pos, key_pos, sliding_window, slopes)
        return online_softmax_step(q, k, v, visible, carry, scale, bias, logits_soft_cap)

    init = (jnp.zeros((rows, padded_dim), jnp.float32), jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    steps = pl.cdiv(jnp.maximum(last_block - first_block, 0), blocks_per_step)
    acc, m, l = lax.fori_loop(0, steps, body, init)
    o_ref[...] = acc.astype(o_ref.dtype)
    m_ref[...], l_ref[...] = m, l


def merge_partitions(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Log-sum-exp merge over axis 0: o [P, ..., D] unnormalised, m/l [P, ...] -> [..., D]."""
    m_max = m.max(axis=0)
    weight = jnp.exp(m - m_max[None])
    total = (l * weight).sum(axis=0)
    out = (o.astype(jnp.float32) * weight[..., None]).sum(axis=0)
    return out / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)[..., None]


def _blocks_per_partition(num_columns: int, block_size: int, num_partitions: int, blocks_per_step: int,
                          sliding_window: int | None) -> int:
    """Blocks each partition walks, a whole number of steps: the partitions together cover a whole table, or
    with a window every block the window can reach from its first block rounded down to a step."""
    reach = num_columns
    if sliding_window is not None:
        # A window of W keys touches at most cdiv(W - 1, block_size) + 1 blocks; rounding its first block
        # down to a step adds up to blocks_per_step - 1 more.
        reach = min(reach, pl.cdiv(sliding_window - 1, block_size) + blocks_per_step)
    return pl.cdiv(pl.cdiv(reach, num_partitions), blocks_per_step) * blocks_per_step


def _launch_decode(layer, seq_lens, tables, q, alibi_slopes, k_cache, v_cache, *, num_partitions: int,
                   interpret: bool, **kernel_options) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One program per (sequence, KV head, partition) of _decode_kernel (its static arguments: kernel_options),
    each over a KV head's group of query heads padded to `rows` (and the head dimension to a power of two);
    returns every partition's (o, m, l) of those rows, for merge_partitions."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, padded_dim = k_cache.shape[3], padded_width(head_dim)
    group = num_heads // num_kv_heads
    rows = max(MIN_ROWS, padded_width(group))
    q_groups = pad_last_axis(q.reshape(batch, num_kv_heads, group, head_dim), padded_dim)
    q_groups = jnp.pad(q_groups, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    slopes = jnp.zeros(num_heads, jnp.float32) if alibi_slopes is None else alibi_slopes.astype(jnp.float32)
    slopes = jnp.pad(slopes.reshape(num_kv_heads, group), ((0, 0), (0, rows - group)))  # laid out as q_groups
    kernel = functools.partial(_decode_kernel, **kernel_options)
    whole_cache = pl.BlockSpec(k_cache.shape, lambda b, h, p: (0, 0, 0, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_partitions),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, p: (0,)),  # layer
            pl.BlockSpec((1,), lambda b, h, p: (b,)),  # seq_lens
            pl.BlockSpec((None, tables.shape[1]), lambda b, h, p: (b, 0)),  # block_tables
            pl.BlockSpec((None, rows), lambda b, h, p: (h, 0)),  # alibi slopes
            pl.BlockSpec((None, None, rows, padded_dim), lambda b, h, p: (b, h, 0, 0)),  # q
            whole_cache,  # k_cache
            whole_cache,  # v_cache
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, padded_dim), lambda b, h, p: (p, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, p: (p, b, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, p: (p, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_partitions, batch, num_kv_heads, rows, padded_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_partitions, batch, num_kv_heads, rows), jnp.float32),
            jax.ShapeDtypeStruct((num_partitions, batch, num_kv_heads, rows), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="paged_decode_attention",
    )(jnp.asarray(layer, jnp.int32).reshape(1), seq_lens.astype(jnp.int32), tables, slopes, q_groups, k_cache, v_cache)


@functools.partial(jax.jit, static_argnames=("num_partitions", "blocks_per_step", "scale", "sliding_window",
                                             "logits_soft_cap", "interpret"))
def paged_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                           seq_lens: jax.Array, layer: jax.Array | int = 0, *, scale: float | None = None,
                           sliding_window: int | None = None, alibi_slopes: jax.Array | None = None,
                           logits_soft_cap: float | None = None, num_partitions: int = 4,
                           blocks_per_step: int = BLOCKS_PER_STEP, interpret: bool = False) -> jax.Array:
    """Attention of one new token per sequence over its paged context.

    Args:
        q: [B, N, D] queries (N query heads).
        k_cache: [L, num_blocks, block_size, K, D] keys (this step's already written).
        v_cache: [L, num_blocks, block_size, K, D] values.
        block_tables: [B, C] int32 physical block of each logical block (padding entries unused).
        seq_lens: [B] int32 context length, new token included (0 = padding row, output 0).
        layer: which layer of the cache to read.
        scale: softmax scale (default 1 / sqrt(D)).
        sliding_window: each query sees only its last `sliding_window` keys, itself included, and only the
            blocks they lie in are read (None: the whole context).
        alibi_slopes: [N] float32 ALiBi slope of each query head: slope * (t - p) is added to the scaled
            score of key position t for the query at p = seq_len - 1 (None: no ALiBi).
        logits_soft_cap: scaled scores become cap * tanh(score / cap), before ALiBi (None: uncapped).
        num_partitions: context partitions per sequence, merged by log-sum-exp (flash-decoding).
        blocks_per_step: KV blocks loaded per loop iteration.
        interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
        [B, N, D] attention outputs, in q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    num_layers, num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    check_query_fits_cache(q, k_cache, v_cache)
    if block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"block_tables {block_tables.shape} and seq_lens {seq_lens.shape} must have batch {batch}")
    check_variant(sliding_window, alibi_slopes, num_heads, logits_soft_cap)
    blocks_per_step = max(blocks_per_step, pl.cdiv(MIN_ROWS, block_size))  # >= 16 keys per dot
    num_columns = block_tables.shape[1]
    per_partition = _blocks_per_partition(num_columns, block_size, num_partitions, blocks_per_step, sliding_window)
    # Partitions start at block 0, or with a window at its first block (at most the last column): padding
    # keeps every step's table read inside the table.
    width = per_partition * num_partitions + (num_columns if sliding_window is not None else 0)
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, width - num_columns)))
    o, m, l = _launch_decode(layer, seq_lens, tables, q, alibi_slopes, k_cache, v_cache,
                             num_partitions=num_partitions, interpret=interpret, block_size=block_size,
                             blocks_per_step=blocks_per_step, blocks_per_partition=per_partition,
                             scale=scale or head_dim**-0.5, sliding_window=sliding_window,
                             alibi=alibi_slopes is not None, logits_soft_cap=logits_soft_cap)
    out = merge_partitions(o, m, l)[:, :, : num_heads // num_kv_heads, :head_dim]  # [B, K, G, D]
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)
