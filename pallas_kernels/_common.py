"""Pieces both attention kernels share: the online-softmax step, tensor-core row padding, and shape checks."""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

MIN_ROWS = 16  # tl.dot needs at least 16 rows: query heads of a group are padded up to this
NEG = float(jnp.finfo(jnp.float32).min)  # the logit of a key a query may not see


def online_softmax_step(q, k, v, visible, carry, scale):
    """One block of keys: update (acc, running max, running sum). q [M, D], k/v [N, D], visible [M, N]."""
    acc, m_prev, l_prev = carry
    logits = jnp.where(visible, plgpu.dot(q, k.T) * scale, NEG)
    m_next = jnp.maximum(m_prev, logits.max(axis=-1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.where(visible, jnp.exp(logits - m_next[:, None]), 0.0)
    acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v)
    return acc, m_next, l_prev * correction + p.sum(axis=-1)


def check_query_fits_cache(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> None:
    """q [*, num_heads, head_dim] against caches [layers, blocks, block_size, num_kv_heads, head_dim]."""
    num_heads, head_dim = q.shape[-2:]
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must have the same shape")
    if k_cache.shape[-1] != head_dim or num_heads % k_cache.shape[-2]:
        raise ValueError(f"q {q.shape} does not fit the cache {k_cache.shape}: head_dim must match and "
                         f"num_heads must be a multiple of num_kv_heads")
