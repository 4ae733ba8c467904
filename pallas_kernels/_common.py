"""Pieces both attention kernels share: the online-softmax step, the sliding-window and ALiBi terms,
tensor-core row padding, and shape checks."""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

MIN_ROWS = 16  # tl.dot needs at least 16 rows: query heads of a group are padded up to this
NEG = float(jnp.finfo(jnp.float32).min)  # the logit of a key a query may not see


def online_softmax_step(q, k, v, visible, carry, scale, bias=None):
    """One block of keys: update (acc, running max, running sum). q [M, D], k/v [N, D], visible [M, N];
    bias [M, N] is added to the scaled logits (ALiBi), or None."""
    acc, m_prev, l_prev = carry
    logits = plgpu.dot(q, k.T) * scale
    if bias is not None:
        logits = logits + bias
    logits = jnp.where(visible, logits, NEG)
    m_next = jnp.maximum(m_prev, logits.max(axis=-1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.where(visible, jnp.exp(logits - m_next[:, None]), 0.0)
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


def check_variant(sliding_window: int | None, alibi_slopes: jax.Array | None, num_heads: int) -> None:
    """ValueErrors for a window under one token or slopes that are not one per query head."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 (or None), got {sliding_window}")
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
