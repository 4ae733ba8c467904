"""The Pallas backend: the GPU kernels of pallas_kernels/, in the interpreter when there is no GPU.

The new keys and values go into the cache with the write_kv kernel. A step with only decode tokens uses the
decode kernel (context split into partitions); a step with prefill chunks runs the ragged kernel over every
sequence at once, with query blocks up to the metadata's static max_query_len.
"""

import functools

import jax
import jax.numpy as jnp

from jax_engine.attention.metadata import AttentionMetadata
from jax_engine.attention.xla import to_cache_dtype
from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.write_kv import write_kv


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    layer: jax.Array, metadata: AttentionMetadata, block_size: int, scale: float, *,
                    interpret: bool, sliding_window: int | None = None, alibi_slopes: jax.Array | None = None,
                    logits_soft_cap: float | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Same contract as jax_engine.attention.xla.paged_attention (its keyword arguments included),
    computed by the Pallas kernels, which with a window read only the blocks it reaches. Their window is static
    (it sizes the blocks read): a model whose layers' windows differ (Gemma 2, Gemma 3) runs on xla (worker.py)."""
    if sliding_window is not None and not isinstance(sliding_window, int):
        raise ValueError("the pallas attention backend takes one sliding window for every layer; a model whose "
                         "layers' windows differ (Gemma 2, Gemma 3) runs on attention_backend 'xla' or 'cpu'")
    k, v = to_cache_dtype(k, k_cache.dtype), to_cache_dtype(v, v_cache.dtype)  # 8-bit: saturated first
    k_cache, v_cache = write_kv(k, v, k_cache, v_cache, metadata.slot_mapping, layer, interpret=interpret)
    num_layers, num_slots, num_kv_heads, head_dim = k_cache.shape
    paged = (num_layers, num_slots // block_size, block_size, num_kv_heads, head_dim)  # a free reshape
    k_blocks, v_blocks = k_cache.reshape(paged), v_cache.reshape(paged)
    num_decode = metadata.decode_token_index.shape[0]
    if metadata.max_query_len == 1:  # decode tokens only
        rows = metadata.decode_token_index
        q_decode = jnp.take(q, rows, axis=0, mode="fill", fill_value=0)
        out = paged_decode_attention(q_decode, k_blocks, v_blocks, metadata.block_tables[:num_decode],
                                     metadata.seq_lens[:num_decode], layer, scale=scale,
                                     sliding_window=sliding_window, alibi_slopes=alibi_slopes,
                                     logits_soft_cap=logits_soft_cap, interpret=interpret)
        return jnp.zeros_like(q).at[rows].set(out, mode="drop"), k_cache, v_cache
    out = ragged_paged_attention(q, k_blocks, v_blocks, metadata.block_tables, metadata.seq_lens,
                                 metadata.query_start_loc, layer, max_q_len=metadata.max_query_len, scale=scale,
                                 sliding_window=sliding_window, alibi_slopes=alibi_slopes,
                                 logits_soft_cap=logits_soft_cap, interpret=interpret)
    return out, k_cache, v_cache


def make_backend(platform: str):
    """The attention function for `platform`: compiled on GPU, interpreted anywhere else."""
    return functools.partial(paged_attention, interpret=platform != "gpu")
