"""Write a step's new keys and values into their cache slots, in place (vLLM's reshape_and_cache).

Grid: (token, KV head). Each program stores one head's key and value vector of one token at the token's
slot in the given layer; padding tokens carry an out-of-range slot and write nothing. The cache buffers are
aliased to the outputs, so nothing else of the cache is copied.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import pad_last_axis, padded_width, store_heads


def _write_kernel(layer_ref, slots_ref, k_ref, v_ref, k_cache_in, v_cache_in, k_cache_ref, v_cache_ref, *,
                  head_dim: int):
    # layer_ref [1]; slots_ref [1] this token's slot; k_ref / v_ref [W] this token's head, W: head_dim padded to
    # a power of two; k_cache_ref / v_cache_ref [L, S, K, D] whole cache (aliased to the inputs)
    del k_cache_in, v_cache_in  # the same buffers as the outputs
    head, slot = pl.program_id(1), slots_ref[0]
    columns = pl.ds(0, k_ref.shape[0])

    @pl.when(slot < k_cache_ref.shape[1])
    def _():
        for new, cache in ((k_ref, k_cache_ref), (v_ref, v_cache_ref)):
            store_heads(cache.at[layer_ref[0], slot, head, columns], new[...].astype(cache.dtype), head_dim)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("k_cache", "v_cache"))
def write_kv(k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array, slot_mapping: jax.Array,
             layer: jax.Array | int = 0, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Store k, v [T, K, D] at `slot_mapping` [T] of `layer` in k_cache, v_cache [L, S, K, D].

    Slots >= S (padding tokens) are skipped. Returns the updated caches (the inputs are donated).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.shape != v.shape or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"k {k.shape}, v {v.shape} must match the caches' [K, D] of {k_cache.shape}, {v_cache.shape}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {slot_mapping.shape} must be ({num_tokens},)")
    padded_dim = padded_width(head_dim)
    k, v = pad_last_axis(k, padded_dim), pad_last_axis(v, padded_dim)
    whole = pl.BlockSpec(k_cache.shape, lambda t, h: (0, 0, 0, 0))
    row = pl.BlockSpec((None, None, padded_dim), lambda t, h: (t, h, 0))
    return pl.pallas_call(
        functools.partial(_write_kernel, head_dim=head_dim),
        grid=(num_tokens, num_kv_heads),
        in_specs=[pl.BlockSpec((1,), lambda t, h: (0,)), pl.BlockSpec((1,), lambda t, h: (t,)), row, row, whole, whole],
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={4: 0, 5: 1},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        name="write_kv",
    )(jnp.asarray(layer, jnp.int32).reshape(1), slot_mapping.astype(jnp.int32), k, v, k_cache, v_cache)
