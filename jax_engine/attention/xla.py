"""Paged attention in plain jnp (the CPU default): gather each sequence's context, masked softmax.

Decode sequences attend with one query each; prefill chunks are gathered into a padded [Bp, Qp] layout
so each chunk is one dense, causally masked block of queries.
"""

import jax
import jax.numpy as jnp

from jax_engine.attention.metadata import AttentionMetadata

_MASKED = -1e30  # finite, so fully masked padding rows give a harmless uniform softmax, not NaN


def _gather_context(cache: jax.Array, layer: jax.Array, block_tables: jax.Array, block_size: int,
                    dtype) -> jax.Array:
    """[L, S, K, D] cache, [B, C] block ids -> [B, C * block_size, K, D] keys or values in token order, in
    `dtype` (the queries': a bfloat16 cache beside a float32 model is attended in float32).

    Gathering whole blocks (block_size x K x D contiguous values each) is several times faster on CPU
    than gathering token slots one by one.
    """
    num_layers, num_slots, num_kv_heads, head_dim = cache.shape
    blocks = cache.reshape(num_layers, num_slots // block_size, block_size, num_kv_heads, head_dim)
    context = blocks[layer, block_tables]  # [B, C, block_size, K, D]
    return context.reshape(block_tables.shape[0], -1, num_kv_heads, head_dim).astype(dtype)


def _masked_scores(scores: jax.Array, query_pos: jax.Array, key_pos: jax.Array, sliding_window: int | None,
                   alibi_slopes: jax.Array | None, logits_soft_cap: float | None) -> jax.Array:
    """scores [B, K, G, Q, T] -> float32, soft-capped, ALiBi added and keys a query may not see at _MASKED.

    query_pos [B, Q], key_pos [T]. A query at p sees key t when 0 <= p - t (causal) and p - t < sliding_window.
    """
    distance = query_pos[:, None, None, :, None] - key_pos  # [B, 1, 1, Q, T]
    visible = distance >= 0
    if sliding_window is not None:
        visible &= distance < sliding_window
    scores = scores.astype(jnp.float32)
    if logits_soft_cap is not None:
        scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
    if alibi_slopes is not None:
        num_kv_heads, group = scores.shape[1:3]
        slopes = jnp.asarray(alibi_slopes, jnp.float32).reshape(num_kv_heads, group)[None, :, :, None, None]
        scores = scores - slopes * distance  # slope * (t - p)
    return jnp.where(visible, scores, _MASKED)


def _visible_values(v: jax.Array, last_pos: jax.Array) -> jax.Array:
    """v [B, T, K, D] with every key past its row's last query position (last_pos [B]) set to zero. Those slots
    hold what the block's last owner left there (or belong to no block: padding), perhaps NaN from another
    request, and a softmax weight of 0 times NaN is NaN: a row must not read anything it may not see."""
    return jnp.where((jnp.arange(v.shape[1]) <= last_pos[:, None])[:, :, None, None], v, 0)


def _softmax_attend(scores: jax.Array, v: jax.Array, spec: str) -> jax.Array:
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum(spec, probs, v)


def _decode(q, k_cache, v_cache, layer, tables, seq_lens, block_size, scale, variant):
    """q [Bd, K, G, D] -> [Bd, K, G, D]: one query per sequence, at position seq_len - 1, over its context.
    `variant`: (sliding_window, alibi_slopes, logits_soft_cap), as _masked_scores takes them."""
    k, v = (_gather_context(cache, layer, tables, block_size, q.dtype) for cache in (k_cache, v_cache))
    scores = jnp.einsum("bkgd,btkd->bkgt", q, k) * scale
    query_pos = (seq_lens - 1)[:, None]  # [Bd, 1]; padding rows (seq_len 0) see nothing
    scores = _masked_scores(scores[..., None, :], query_pos, jnp.arange(k.shape[1]), *variant)
    return _softmax_attend(scores[..., 0, :], _visible_values(v, seq_lens - 1), "bkgt,btkd->bkgd")


def _prefill(q, positions, k_cache, v_cache, layer, tables, seq_lens, block_size, scale, variant):
    """q [Bp, Qp, K, G, D], positions [Bp, Qp] -> [Bp, Qp, K, G, D], causal over the context."""
    k, v = (_gather_context(cache, layer, tables, block_size, q.dtype) for cache in (k_cache, v_cache))
    scores = jnp.einsum("bqkgd,btkd->bkgqt", q, k) * scale
    scores = _masked_scores(scores, positions, jnp.arange(k.shape[1]), *variant)
    return _softmax_attend(scores, _visible_values(v, seq_lens - 1), "bkgqt,btkd->bqkgd")


def to_cache_dtype(x: jax.Array, dtype) -> jax.Array:
    """x rounded to the cache's dtype. An 8-bit float saturates at its largest finite value, as vLLM's fp8 cache
    does: a plain cast makes NaN (e4m3) or infinity (e5m2) of anything beyond."""
    if jnp.dtype(dtype).itemsize == 1:
        largest = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -largest, largest)
    return x.astype(dtype)


def write_kv(k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Store the step's keys and values at their slots of `layer`; padding slots (out of range) are dropped."""
    if slot_mapping.shape[0] == 1:
        # XLA turns a one-row scatter into a dynamic-update-slice that XLA:CPU does not update in place
        # inside the model: every layer rewrote the whole cache (2 s a step with a 1 GB cache). A second,
        # dropped row keeps it a scatter, which is done in place.
        k, v = jnp.concatenate([k, k]), jnp.concatenate([v, v])
        slot_mapping = jnp.concatenate([slot_mapping, jnp.full_like(slot_mapping, k_cache.shape[1])])
    k_cache = k_cache.at[layer, slot_mapping].set(to_cache_dtype(k, k_cache.dtype), mode="drop")
    v_cache = v_cache.at[layer, slot_mapping].set(to_cache_dtype(v, v_cache.dtype), mode="drop")
    return k_cache, v_cache


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    layer: jax.Array, metadata: AttentionMetadata, block_size: int, scale: float, *,
                    sliding_window: int | None = None, alibi_slopes: jax.Array | None = None,
                    logits_soft_cap: float | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write the step's keys and values, then attend every new token over its sequence's context.

    Every sequence's context is gathered whole: a sliding window masks keys here but saves no reads.

    Args:
        q: [T, N, D] queries of the step's tokens.
        k: [T, K, D] their keys; v: [T, K, D] their values.
        k_cache: [L, num_slots, K, D] every layer's keys.
        v_cache: [L, num_slots, K, D] every layer's values.
        layer: the layer to attend in (a scalar array, so every layer shares one compiled attention).
        metadata: the batch layout (see AttentionMetadata).
        block_size: tokens per block.
        scale: softmax scale.
        sliding_window: each token sees only its last `sliding_window` keys, itself included (None: all).
        alibi_slopes: [N] float32 ALiBi slope of each query head: slope * (t - p) is added to the scaled
            score of key position t for the token at position p (None: no ALiBi).
        logits_soft_cap: scaled scores become cap * tanh(score / cap) before ALiBi (None: uncapped).

    Returns:
        ([T, N, D] attention output, rows of padding tokens zeros or garbage but never NaN; k_cache; v_cache).
    """
    k_cache, v_cache = write_kv(k, v, k_cache, v_cache, layer, metadata.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    grouped = q.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = jnp.zeros_like(grouped)
    variant = (sliding_window, alibi_slopes, logits_soft_cap)
    num_decode = metadata.decode_token_index.shape[0]
    if num_decode:
        rows = metadata.decode_token_index
        qd = jnp.take(grouped, rows, axis=0, mode="fill", fill_value=0)
        o = _decode(qd, k_cache, v_cache, layer, metadata.block_tables[:num_decode],
                    metadata.seq_lens[:num_decode], block_size, scale, variant)
        out = out.at[rows].set(o, mode="drop")
    if metadata.prefill_token_index.shape[0]:
        rows = metadata.prefill_token_index  # [Bp, Qp]
        qp = jnp.take(grouped, rows, axis=0, mode="fill", fill_value=0)
        positions = jnp.take(metadata.positions, rows, axis=0, mode="fill", fill_value=0)
        o = _prefill(qp, positions, k_cache, v_cache, layer, metadata.block_tables[num_decode:],
                     metadata.seq_lens[num_decode:], block_size, scale, variant)
        out = out.at[rows].set(o, mode="drop")
    return out.reshape(num_tokens, num_heads, head_dim), k_cache, v_cache
