"""Ragged paged attention in Pallas (Triton lowering): a whole mixed step in one launch.

The step's new tokens are flat: each sequence contributes a prefill chunk or one decode token, starting at
`query_start_loc[s]`. Grid: (sequence, KV head, query block). A program takes up to `block_q` of the
sequence's queries (with all query heads of the KV-head group, padded to a power of two: block_q x group
rows), walks the sequence's blocks up to the last query's position with an online softmax, masks causally
inside the chunk, and writes only its own rows. With a sliding window it starts at the step holding its first query's window start.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (MIN_ROWS, NEG, check_query_fits_cache, check_variant, load_blocks,
                                    online_softmax_step, pad_last_axis, padded_width, visible_and_bias, window_start)


def _ragged_kernel(layer_ref, starts_ref, lens_ref, tables_ref, slopes_ref, q_ref, k_ref, v_ref, o_ref, *,
                   block_size: int, blocks_per_step: int, block_q: int, group: int, scale: float,
                   sliding_window: int | None, alibi: bool, logits_soft_cap: float | None):
    # layer_ref [1]; starts_ref [B + 1] query offsets; lens_ref [B] context lengths
    # tables_ref [C] this sequence's blocks; slopes_ref [block_q * G] ALiBi slope of each query row of this KV
    # head (read only with alibi); q_ref / o_ref [T + block_q, K, G, W] whole (padded) batch, G and W (the head
    # dimension) padded to powers of two; k_ref / v_ref [L, NB, bs, K, D] whole cache
    seq, head, q_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    start, q_len, seq_len = starts_ref[seq], starts_ref[seq + 1] - starts_ref[seq], lens_ref[seq]
    first_row = q_block * block_q
    padded_dim = q_ref.shape[-1]
    keys_per_step = blocks_per_step * block_size

    @pl.when(first_row < q_len)
    def _():
        rows = pl.ds(start + first_row, block_q)
        q = q_ref[rows, head, :, :].astype(jnp.float32).reshape(block_q * group, padded_dim)
        # Query i of the chunk sits at position seq_len - q_len + i; rows repeat it once per query head. Rows past
        # the chunk (never stored) take its last position: one past it would see keys beyond the context.
        q_pos = jnp.minimum(seq_len - q_len + first_row + jnp.arange(block_q * group) // group, seq_len - 1)
        last_key = seq_len - q_len + jnp.minimum(first_row + block_q, q_len)  # exclusive
        first_key = window_start(seq_len - q_len + first_row + 1, sliding_window)  # of the first query's window
        slopes = slopes_ref[...] if alibi else None

        def body(i, carry):
            ids = tables_ref[pl.ds(i * blocks_per_step, blocks_per_step)]
            k, v = (load_blocks(ref, layer, ids, head, padded_dim) for ref in (k_ref, v_ref))
            key_pos = i * keys_per_step + jnp.arange(keys_per_step)
            visible, bias = visible_and_bias(q_pos, key_pos, sliding_window, slopes)
            return online_softmax_step(q, k, v, visible, carry, scale, bias, logits_soft_cap)

        init = (jnp.zeros((block_q * group, padded_dim), jnp.float32), jnp.full((block_q * group,), NEG, jnp.float32),
                jnp.zeros((block_q * group,), jnp.float32))
        acc, _, l = lax.fori_loop(first_key // keys_per_step, pl.cdiv(last_key, keys_per_step), body, init)
        out = (acc / jnp.maximum(l, 1e-30)[:, None]).reshape(block_q, group, padded_dim)
        # A masked store: rows past this chunk belong to the next sequence's programs.
        valid = first_row + jnp.arange(block_q) < q_len
        plgpu.store(o_ref.at[rows, head, :, :], out.astype(o_ref.dtype), mask=valid[:, None, None])


def _launch_ragged(layer, query_start_loc, seq_lens, tables, q, alibi_slopes, k_cache, v_cache, *,
                   num_query_blocks: int, interpret: bool, **kernel_options) -> jax.Array:
    """One program per (sequence, KV head, query block) of _ragged_kernel (its static arguments: kernel_options,
    whose `group` is already padded to a power of two); returns the attention of q's rows [T, K, G, D]."""
    (num_tokens, num_heads, head_dim), num_kv_heads = q.shape, k_cache.shape[3]
    batch, columns = seq_lens.shape[0], tables.shape[1]
    block_q, padded_group = kernel_options["block_q"], kernel_options["group"]
    group = num_heads // num_kv_heads
    # Pad the flat batch by one query block so a program's row window never runs off the end; the group and the
    # head dimension to powers of two (the padded query heads are zeros whose outputs are dropped).
    q_flat = pad_last_axis(q.reshape(num_tokens, num_kv_heads, group, head_dim), padded_width(head_dim))
    q_flat = jnp.pad(q_flat, ((0, block_q), (0, 0), (0, padded_group - group), (0, 0)))
    slopes = jnp.zeros(num_heads, jnp.float32) if alibi_slopes is None else alibi_slopes.astype(jnp.float32)
    slopes = pad_last_axis(slopes.reshape(num_kv_heads, group), padded_group)
    slopes = jnp.tile(slopes, (1, block_q))  # [K, block_q * G], as a program's q rows
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_ragged_kernel, **kernel_options),
        grid=(batch, num_kv_heads, num_query_blocks),
        in_specs=[whole((1,)), whole((batch + 1,)), whole((batch,)),
                  pl.BlockSpec((None, columns), lambda s, h, b: (s, 0)),
                  pl.BlockSpec((None, block_q * padded_group), lambda s, h, b: (h, 0)),  # alibi slopes
                  whole(q_flat.shape), whole(k_cache.shape), whole(v_cache.shape)],
        out_specs=whole(q_flat.shape),
        out_shape=jax.ShapeDtypeStruct(q_flat.shape, q_flat.dtype),
        input_output_aliases={},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="ragged_paged_attention",
    )(jnp.asarray(layer, jnp.int32).reshape(1), query_start_loc.astype(jnp.int32), seq_lens.astype(jnp.int32),
      tables, slopes, q_flat, k_cache, v_cache)
    return out[:num_tokens, :, :group, :head_dim]


@functools.partial(jax.jit, static_argnames=("max_q_len", "block_q", "blocks_per_step", "scale", "sliding_window",
                                             "logits_soft_cap", "interpret"))
def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                           seq_lens: jax.Array, query_start_loc: jax.Array, layer: jax.Array | int = 0, *,
                           max_q_len: int, scale: float | None = None, sliding_window: int | None = None,
                           alibi_slopes: jax.Array | None = None, logits_soft_cap: float | None = None,
                           block_q: int = 16, blocks_per_step: int = 2, interpret: bool = False) -> jax.Array:
    """Causal attention of a step's flat tokens (prefill chunks and decodes mixed) over paged contexts.

    Args:
        q: [T, N, D] queries of the step's tokens, sequence after sequence.
        k_cache: [L, num_blocks, block_size, K, D] keys (this step's already written).
        v_cache: [L, num_blocks, block_size, K, D] values.
        block_tables: [B, C] int32 physical blocks of each sequence.
        seq_lens: [B] int32 context length of each sequence, this step's tokens included.
        query_start_loc: [B + 1] int32 offsets of each sequence's tokens in q (non-decreasing;
            a sequence with no tokens is padding).
        layer: which layer of the cache to read.
        max_q_len: an upper bound on any sequence's number of tokens (sets the grid).
        scale: softmax scale (default 1 / sqrt(D)).
        sliding_window: each query sees only its last `sliding_window` keys, itself included; a program
            reads from the step holding its first query's window start (None: from block 0).
        alibi_slopes: [N] float32 ALiBi slope of each query head: slope * (t - p) is added to the scaled
            score of key position t for the query at position p (None: no ALiBi).
        logits_soft_cap: scaled scores become cap * tanh(score / cap), before ALiBi (None: uncapped).
        block_q: queries per program.
        blocks_per_step: KV blocks loaded per loop iteration.
        interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
        [T, N, D] attention outputs (rows not covered by any sequence are zero).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_layers, num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    batch = block_tables.shape[0]
    check_query_fits_cache(q, k_cache, v_cache)
    if seq_lens.shape != (batch,) or query_start_loc.shape != (batch + 1,):
        raise ValueError(f"seq_lens {seq_lens.shape} must be ({batch},) and query_start_loc "
                         f"{query_start_loc.shape} must be ({batch + 1},) for block_tables {block_tables.shape}")
    check_variant(sliding_window, alibi_slopes, num_heads, logits_soft_cap)
    group = padded_width(num_heads // num_kv_heads)
    block_q = max(padded_width(block_q), pl.cdiv(MIN_ROWS, group))
    blocks_per_step = max(blocks_per_step, pl.cdiv(MIN_ROWS, block_size))
    columns = pl.cdiv(block_tables.shape[1], blocks_per_step) * blocks_per_step
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, columns - block_tables.shape[1])))
    out = _launch_ragged(layer, query_start_loc, seq_lens, tables, q, alibi_slopes, k_cache, v_cache,
                         num_query_blocks=pl.cdiv(max_q_len, block_q), interpret=interpret, block_size=block_size,
                         blocks_per_step=blocks_per_step, block_q=block_q, group=group, scale=scale or head_dim**-0.5,
                         sliding_window=sliding_window, alibi=alibi_slopes is not None,
                         logits_soft_cap=logits_soft_cap)
    return out.reshape(num_tokens, num_heads, head_dim)
