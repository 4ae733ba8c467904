r"""PagedAttention: attention over keys and values scattered across fixed-size blocks.

The KV cache of one layer is an array of physical blocks, `[num_blocks, block_size, num_kv_heads,
head_dim]`. A token's keys live at its *slot*, `block_id * block_size + offset`; a sequence's keys are
found through its block table.

Softmax attention is computed block by block. For query $q_i$ and the keys $K_j$ of logical block $j$:

$$ m_j = \max_t \frac{q_i k_t^\top}{\sqrt{d}}, \qquad
   \ell_j = \sum_{t \in j} e^{q_i k_t^\top/\sqrt{d} - m_j}, \qquad
   o_j = \sum_{t \in j} e^{q_i k_t^\top/\sqrt{d} - m_j}\, v_t $$

and the per-block partial results are merged exactly at the end:

$$ m = \max_j m_j, \qquad \text{out}_i = \frac{\sum_j e^{m_j - m} o_j}{\sum_j e^{m_j - m} \ell_j}. $$

No block needs to be next to another in memory, which is the point.
"""

from dataclasses import dataclass

import numpy as np

from reference.block_manager import cdiv


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens sit in the flat batch and in the cache.

    The batch concatenates every scheduled sequence's new tokens (a prefill chunk or one decode token):

        tokens:          [ seq 0 chunk | seq 1 decode | seq 2 chunk ... ]
        query_start_loc:   0            3              4     ...  num_tokens
    """

    slot_mapping: np.ndarray  # [num_tokens] cache slot each new token's K/V is written to
    query_start_loc: np.ndarray  # [num_seqs + 1] start of each sequence's tokens in the batch
    seq_lens: np.ndarray  # [num_seqs] context length of each sequence, new tokens included
    block_tables: list[list[int]]  # [num_seqs][num_logical_blocks] physical block ids


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray) -> None:
    """Store new keys/values `[num_tokens, num_kv_heads, head_dim]` at their slots, in place."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)[slot_mapping] = k
    v_cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)[slot_mapping] = v


def _attend_block(q, k, v, query_pos, key_pos, scale):
    """Partial softmax of queries [n, kv, g, d] over one block's keys [b, kv, d]: (m, l, o)."""
    scores = np.einsum("nkgd,bkd->nkgb", q, k) * scale
    visible = key_pos[None, None, None, :] <= query_pos[:, None, None, None]  # causal mask
    scores = np.where(visible, scores, -np.inf)
    m = scores.max(axis=-1)  # [n, kv, g]; -inf where the whole block is in a query's future
    safe_m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(visible, np.exp(scores - safe_m[..., None]), 0.0)
    return m, p.sum(axis=-1), np.einsum("nkgb,bkd->nkgd", p, v)


def _attend_sequence(q, k_cache, v_cache, block_table, seq_len, scale):
    """Attention of one sequence's new queries [n, heads, d] over its first `seq_len` cached tokens."""
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    q = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)  # heads grouped by KV head
    query_pos = np.arange(seq_len - n, seq_len)
    partials = []
    for j in range(cdiv(seq_len, block_size)):
        valid = min(block_size, seq_len - j * block_size)
        key_pos = j * block_size + np.arange(valid)
        block = block_table[j]
        partials.append(_attend_block(q, k_cache[block, :valid], v_cache[block, :valid], query_pos, key_pos, scale))
    m_all = np.stack([m for m, _, _ in partials])  # [blocks, n, kv, g]
    m = m_all.max(axis=0)  # finite: every query sees at least key 0
    weights = np.exp(m_all - m)  # e^{m_j - m}; 0 for blocks entirely in the future
    l = sum(w * l_j for w, (_, l_j, _) in zip(weights, partials))
    o = sum(w[..., None] * o_j for w, (_, _, o_j) in zip(weights, partials))
    return (o / l[..., None]).reshape(n, num_heads, head_dim)


def paged_attention(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, metadata: AttentionMetadata, scale: float
) -> np.ndarray:
    """Causal attention of every new token over its own sequence's cached context.

    Works for any mix of prefill chunks and decode tokens, and for MHA, GQA and MQA (query heads are a
    multiple of KV heads). New K/V must already be written with `write_kv`.

    Args:
        q: [num_tokens, num_heads, head_dim] queries of the batch's new tokens.
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim] one layer's key cache.
        v_cache: the same layer's value cache, same shape.
        metadata: batch layout; see AttentionMetadata.
        scale: softmax scale, usually 1 / sqrt(head_dim).

    Returns:
        [num_tokens, num_heads, head_dim] attention outputs.
    """
    out = np.empty_like(q)
    starts = metadata.query_start_loc
    for i, (seq_len, table) in enumerate(zip(metadata.seq_lens, metadata.block_tables)):
        start, end = starts[i], starts[i + 1]
        out[start:end] = _attend_sequence(q[start:end], k_cache, v_cache, table, int(seq_len), scale)
    return out


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Plain causal softmax attention for one sequence, the textbook formula, for checking.

    Args:
        q: [n, num_heads, d], the last n positions of the sequence.
        k: [seq_len, num_kv_heads, d] keys of the whole sequence.
        v: [seq_len, num_kv_heads, d] values of the whole sequence.
        scale: softmax scale.
    """
    n, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [seq_len, heads, d]
    scores = np.einsum("nhd,thd->hnt", q, k) * scale
    query_pos = np.arange(seq_len - n, seq_len)
    scores = np.where(np.arange(seq_len)[None, None, :] <= query_pos[None, :, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hnt,thd->nhd", probs, v)
