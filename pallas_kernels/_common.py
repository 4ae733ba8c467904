"""Pieces the kernels share: the online-softmax step, the sliding-window and ALiBi terms, padding to the
shapes Triton accepts, and shape checks.

Triton's lowering takes only arrays whose every dimension is a power of two (and tl.dot at least 16 rows).
So the query heads of a KV-head group are padded to a power of two (GQA group 3: SmolLM2's 9 query heads over
3 KV heads), and a head dimension that is not one (80, 96: GPT-NeoX, Phi-3) is read as the next power of two
with a masked load: the columns past it read as zeros, which add nothing to a dot product, and are never
stored. The cache keeps its real head dimension; only the in-kernel arrays are padded.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_ROWS = 16  # tl.dot needs at least 16 rows: query heads of a group are padded up to this
NEG = float(jnp.finfo(jnp.float32).min)  # the logit of a key a query may not see


def padded_width(n: int) -> int:
    """n rounded up to a power of two: the width of an in-kernel array holding n things."""
    return pl.next_power_of_2(n)


def pad_last_axis(x: jax.Array, width: int) -> jax.Array:
    """x with zeros appended along its last axis up to `width`."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def load_blocks(cache_ref, layer, ids: jax.Array, head, padded_dim: int) -> jax.Array:
    """Blocks `ids` [n] of KV head `head` in `layer` of a cache [L, NB, bs, K, D], as float32 [n * bs, padded_dim].

    A head dimension short of padded_dim is gathered with index arrays on every axis (a form both Triton and
    the interpreter take) and a mask: the columns past it read as zeros."""
    block_size, head_dim = cache_ref.shape[2], cache_ref.shape[-1]
    if head_dim == padded_dim:
        blocks = cache_ref[layer, ids, :, head, :]
    else:
        columns = jnp.arange(padded_dim)
        index = (layer, ids[:, None, None], jnp.arange(block_size)[None, :, None], head, columns[None, None, :])
        mask = jnp.broadcast_to(columns < head_dim, (ids.shape[0], block_size, padded_dim))
        blocks = plgpu.load(cache_ref.at[index], mask=mask, other=0)
    return blocks.reshape(ids.shape[0] * block_size, padded_dim).astype(jnp.float32)


def store_heads(ref, value: jax.Array, head_dim: int) -> None:
    """value [W] stored into ref (a view of width W, a head dimension padded to a power of two): only the first
    head_dim columns."""
    if value.shape[-1] == head_dim:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=jnp.arange(value.shape[-1]) < head_dim)


def online_softmax_step(q, k, v, visible, carry, scale, bias=None, soft_cap: float | None = None):
    """One block of keys: update (acc, running max, running sum). q [M, D], k/v [N, D], visible [M, N];
    the scaled logits are soft-capped (cap * tanh(logit / cap), Gemma 2) when soft_cap is set, then bias
    [M, N] (ALiBi) is added, or None."""
    acc, m_prev, l_prev = carry
    logits = plgpu.dot(q, k.T) * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    if bias is not None:
        logits = logits + bias
    logits = jnp.where(visible, logits, NEG)
    m_next = jnp.maximum(m_prev, logits.max(axis=-1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.where(visible, jnp.exp(logits - m_next[:, None]), 0.0)
    # Keys no row sees (past the context: what the block's last owner left, perhaps NaN) are zeroed, for their
    # weight of 0 times NaN would be NaN: a row must not read another request's values.
    v = jnp.where(visible.astype(jnp.float32).max(axis=0)[:, None] > 0, v, 0)  # (Triton lowers no reduce_or)
    acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v)
    return acc, m_next, l_prev * correction + p.sum(axis=-1)


def visible_and_bias(query_pos, key_pos, sliding_window: int | None, slopes):
    """(visible [M, N], ALiBi bias [M, N] or None) for query rows at query_pos [M] and keys at key_pos [N].

    A query at p sees key t when t <= p and p - t < sliding_window; ALiBi adds slope * (t - p), slopes [M]
    being each row's head's slope (None: no ALiBi).
    """
    distance = query_pos[:, None] - key_pos[None, :]
    visible = distance >= 0
    if sliding_window is not None:
        visible = visible & (distance < sliding_window)
    bias = None if slopes is None else -slopes[:, None] * distance.astype(jnp.float32)
    return visible, bias


def window_start(seq_len, sliding_window: int | None):
    """The first key position a query at seq_len - 1 sees: 0, or the start of its window (traced ints)."""
    return 0 if sliding_window is None else jnp.maximum(seq_len - sliding_window, 0)


def check_variant(sliding_window: int | None, alibi_slopes: jax.Array | None, num_heads: int,
                  logits_soft_cap: float | None = None) -> None:
    """ValueErrors for a window under one token, slopes that are not one per query head, a cap not above 0."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 (or None), got {sliding_window}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive (or None), got {logits_soft_cap}")
    if alibi_slopes is not None and alibi_slopes.shape != (num_heads,):
        raise ValueError(f"alibi_slopes {alibi_slopes.shape} must be ({num_heads},): one slope per query head")


def check_query_fits_cache(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> None:
    """q [*, num_heads, head_dim] against caches [layers, blocks, block_size, num_kv_heads, head_dim]."""
    num_heads, head_dim = q.shape[-2:]
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must have the same shape")
    if k_cache.shape[-1] != head_dim or num_heads % k_cache.shape[-2]:
        raise ValueError(f"q {q.shape} does not fit the cache {k_cache.shape}: head_dim must match and "
                         f"num_heads must be a multiple of num_kv_heads")
