"""Decode attention over a contiguous KV cache in Pallas (Triton lowering): the paged kernel's yardstick.

The same algorithm as paged_decode_attention (grid (sequence, KV head, context partition), one KV head's
query group per program, online softmax, partitions merged by log-sum-exp) reading each sequence's keys from
one contiguous run of the cache, [L, B, T, K, D], with plain slices instead of block-table gathers. It is
what a FasterTransformer-style engine does, and the paper's Figure 18a sets vLLM's paged kernel against
such a kernel at the same shapes: the difference is the cost of paging (20-26% there). The engine never
uses it; `python -m jax_engine.bench.gpu_check` times both.

    keys of sequence b, KV head h, partition p (keys_per_partition = n x keys_per_step):
    cache[layer, b, :, h, :]  |p=0: step step ... |p=1: step step ... |  ...  | (past seq_len: masked)
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import MIN_ROWS, NEG, check_query_fits_cache, online_softmax_step, visible_and_bias
from pallas_kernels.paged_decode_attention import merge_partitions


def _contiguous_kernel(layer_ref, lens_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, keys_per_step: int,
                       keys_per_partition: int, scale: float):
    # layer_ref [1]; lens_ref [1] (this sequence); q_ref [M, D] (one KV head's query group, padded)
    # k_ref/v_ref [L, B, T, K, D] (whole cache); o_ref [M, D], m_ref [M], l_ref [M]: this partition's
    # unnormalised output, max and sum
    seq, head, partition = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, seq_len = layer_ref[0], lens_ref[0]
    q = q_ref[...].astype(jnp.float32)
    rows, head_dim = q.shape
    first_key = partition * keys_per_partition
    last_key = jnp.minimum(seq_len, first_key + keys_per_partition)  # exclusive
    query_pos = jnp.full((rows,), seq_len - 1)

    def body(i, carry):
        start = first_key + i * keys_per_step
        k = k_ref[layer, seq, pl.ds(start, keys_per_step), head, :].astype(jnp.float32)  # [S, D]
        v = v_ref[layer, seq, pl.ds(start, keys_per_step), head, :].astype(jnp.float32)  # [S, D]
        visible, _ = visible_and_bias(query_pos, start + jnp.arange(keys_per_step), None, None)
        return online_softmax_step(q, k, v, visible, carry, scale)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    steps = pl.cdiv(jnp.maximum(last_key - first_key, 0), keys_per_step)
    acc, m, l = lax.fori_loop(0, steps, body, init)
    o_ref[...] = acc.astype(o_ref.dtype)
    m_ref[...], l_ref[...] = m, l


def _launch_contiguous(layer, seq_lens, q, k_cache, v_cache, *, num_partitions: int, interpret: bool,
                       **kernel_options) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One program per (sequence, KV head, partition), as _launch_decode; returns every partition's (o, m, l)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[3]
    group = num_heads // num_kv_heads
    rows = max(MIN_ROWS, pl.next_power_of_2(group))
    q_groups = jnp.pad(q.reshape(batch, num_kv_heads, group, head_dim), ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    whole_cache = pl.BlockSpec(k_cache.shape, lambda b, h, p: (0, 0, 0, 0, 0))

    def per_partition(*shape: int) -> jax.ShapeDtypeStruct:  # an output of every (partition, sequence, KV head)
        return jax.ShapeDtypeStruct((num_partitions, batch, num_kv_heads, *shape), jnp.float32)

    return pl.pallas_call(
        functools.partial(_contiguous_kernel, **kernel_options),
        grid=(batch, num_kv_heads, num_partitions),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, p: (0,)),  # layer
            pl.BlockSpec((1,), lambda b, h, p: (b,)),  # seq_lens
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, p: (b, h, 0, 0)),  # q
            whole_cache,  # k_cache
            whole_cache,  # v_cache
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, p: (p, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, p: (p, b, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, p: (p, b, h, 0)),
        ],
        out_shape=[per_partition(rows, head_dim), per_partition(rows), per_partition(rows)],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),  # the paged kernel's
        name="contiguous_decode_attention",
    )(jnp.asarray(layer, jnp.int32).reshape(1), seq_lens.astype(jnp.int32), q_groups, k_cache, v_cache)


@functools.partial(jax.jit, static_argnames=("num_partitions", "keys_per_step", "scale", "interpret"))
def contiguous_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, seq_lens: jax.Array,
                                layer: jax.Array | int = 0, *, scale: float | None = None, num_partitions: int = 4,
                                keys_per_step: int = 32, interpret: bool = False) -> jax.Array:
    """Attention of one new token per sequence over its context, held contiguously in the cache.

    Args:
        q: [B, N, D] queries (N query heads; D a power of two, as Triton's arrays must be).
        k_cache: [L, B, T, K, D] keys, sequence b's first seq_lens[b] positions in row b (this step's written).
        v_cache: [L, B, T, K, D] values.
        seq_lens: [B] int32 context length, new token included, at most T (0 = padding row, output 0).
        layer: which layer of the cache to read.
        scale: softmax scale (default 1 / sqrt(D)).
        num_partitions: context partitions per sequence, merged by log-sum-exp (flash-decoding).
        keys_per_step: keys loaded per loop iteration (the paged kernel's blocks_per_step x block_size: 32 at
            its defaults); T must be a multiple of it, so no step reads past a sequence's row.
        interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
        [B, N, D] attention outputs, in q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    _, cache_batch, max_len, num_kv_heads, _ = k_cache.shape
    check_query_fits_cache(q, k_cache, v_cache)
    if cache_batch != batch or seq_lens.shape != (batch,):
        raise ValueError(f"k_cache {k_cache.shape} and seq_lens {seq_lens.shape} must have batch {batch}")
    if keys_per_step < MIN_ROWS or keys_per_step & (keys_per_step - 1) or head_dim & (head_dim - 1):
        raise ValueError(f"keys_per_step {keys_per_step} (at least {MIN_ROWS}) and head_dim {head_dim} must be "
                         "powers of two")
    if max_len % keys_per_step:
        raise ValueError(f"the cache's length {max_len} (k_cache {k_cache.shape}) must be a multiple of "
                         f"keys_per_step {keys_per_step}")
    keys_per_partition = pl.cdiv(pl.cdiv(max_len, num_partitions), keys_per_step) * keys_per_step
    o, m, l = _launch_contiguous(layer, seq_lens, q, k_cache, v_cache, num_partitions=num_partitions,
                                 interpret=interpret, keys_per_step=keys_per_step,
                                 keys_per_partition=keys_per_partition, scale=scale or head_dim**-0.5)
    out = merge_partitions(o, m, l)[:, :, : num_heads // num_kv_heads]  # [B, K, G, D]
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)
