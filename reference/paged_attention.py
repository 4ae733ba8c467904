r"""PagedAttention: attention over keys and values scattered across fixed-size blocks.

The KV cache of one layer is an array of physical blocks, `[num_blocks, block_size, num_kv_heads,
head_dim]`. A token's keys live at its *slot*, `block_id * block_size + offset`; a sequence's keys are
found through its block table.

Softmax attention is computed block by block. (The paper's Eq. 4 computes every block's scores first and
normalises once over all of them, as vLLM's first kernel did; merging per-block partial results, below, is
FlashAttention's online softmax as flash-decoding and vLLM's `paged_attention_v2` use it: the same result,
with no pass over all scores at once.) For query $q_i$ and the keys $K_j$ of logical block $j$:

$$ m_j = \max_t \frac{q_i k_t^\top}{\sqrt{d}}, \qquad
   \ell_j = \sum_{t \in j} e^{q_i k_t^\top/\sqrt{d} - m_j}, \qquad
   o_j = \sum_{t \in j} e^{q_i k_t^\top/\sqrt{d} - m_j}\, v_t $$

and the per-block partial results are merged exactly at the end:

$$ m = \max_j m_j, \qquad \text{out}_i = \frac{\sum_j e^{m_j - m} o_j}{\sum_j e^{m_j - m} \ell_j}. $$

No block needs to be next to another in memory, which is the point.

Two variants change which keys a query sees and how it scores them. With a *sliding window* of $W$
tokens (Mistral), the query at position $p$ sees key position $t$ only if $p - W < t \le p$: its last
$W$ keys, itself included (the plain causal mask is $t \le p$). With *ALiBi* (BLOOM, MPT), every head
$h$ has a slope $a_h$ and its scores get a linear penalty for distance,

$$ s_{pt} = \frac{q_p k_t^\top}{\sqrt{d}} + a_h\,(t - p), $$

added before the softmax. (BLOOM adds $a_h t$; the two differ by a constant per row, which the softmax
cancels; $t - p$ keeps the numbers small at long positions.) A window also saves work in a paged cache:
blocks wholly before the window of a chunk's first query are never read. With a *soft cap* $c$ (Gemma 2),
every scaled score is squashed into $(-c, c)$ before anything is added to it,

$$ s_{pt} = c \tanh\!\Big(\frac{q_p k_t^\top}{c\sqrt{d}}\Big), $$

which leaves small scores almost as they were and keeps one large score from taking all the weight.
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


def _visible_keys(query_pos: np.ndarray, key_pos: np.ndarray, sliding_window: int | None) -> np.ndarray:
    """[n, t] mask: causal, and within the query's last `sliding_window` positions when there is a window."""
    distance = query_pos[:, None] - key_pos[None, :]  # how far back each key is
    visible = distance >= 0
    if sliding_window is not None:
        visible &= distance < sliding_window
    return visible


def _alibi_bias(alibi_slopes: np.ndarray, query_pos: np.ndarray, key_pos: np.ndarray) -> np.ndarray:
    """[n, heads, t] ALiBi term slope_h * (t - p): 0 at the query's own key, -slope_h for each step back."""
    return alibi_slopes[None, :, None] * (key_pos[None, None, :] - query_pos[:, None, None])


def soft_cap(scores: np.ndarray, cap: float | None) -> np.ndarray:
    """cap * tanh(scores / cap): scores squashed into (-cap, cap); unchanged without a cap."""
    return scores if cap is None else cap * np.tanh(scores / cap)


def _attend_block(q, k, v, query_pos, key_pos, scale, sliding_window, alibi_slopes, logits_soft_cap=None):
    """Partial softmax of queries [n, kv, g, d] over one block's keys [b, kv, d]: (m, l, o)."""
    n, num_kv_heads, group, _ = q.shape
    scores = soft_cap(np.einsum("nkgd,bkd->nkgb", q, k) * scale, logits_soft_cap)
    if alibi_slopes is not None:
        scores = scores + _alibi_bias(alibi_slopes, query_pos, key_pos).reshape(n, num_kv_heads, group, -1)
    visible = _visible_keys(query_pos, key_pos, sliding_window)[:, None, None, :]
    scores = np.where(visible, scores, -np.inf)
    m = scores.max(axis=-1)  # [n, kv, g]; -inf where the whole block is in a query's future
    safe_m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(visible, np.exp(scores - safe_m[..., None]), 0.0)
    return m, p.sum(axis=-1), np.einsum("nkgb,bkd->nkgd", p, v)


def _first_block(first_query_pos: int, block_size: int, sliding_window: int | None) -> int:
    """The first logical block any query of the chunk sees: block 0, or where the earliest window starts.

        window 6, block_size 4, first query at position 9: it sees keys 4..9
        keys   [0 1 2 3][4 5 6 7][8 9 . .]
        block   0        1        2
                skipped  ^ the first block read
    """
    if sliding_window is None:
        return 0
    return max(0, first_query_pos - sliding_window + 1) // block_size


def _attend_sequence(q, k_cache, v_cache, block_table, seq_len, scale, sliding_window, alibi_slopes,
                     logits_soft_cap):
    """Attention of one sequence's new queries [n, heads, d] over its first `seq_len` cached tokens."""
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    q = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)  # heads grouped by KV head
    query_pos = np.arange(seq_len - n, seq_len)
    partials = []
    for j in range(_first_block(seq_len - n, block_size, sliding_window), cdiv(seq_len, block_size)):
        valid = min(block_size, seq_len - j * block_size)
        key_pos = j * block_size + np.arange(valid)
        block = block_table[j]
        partials.append(_attend_block(q, k_cache[block, :valid], v_cache[block, :valid], query_pos, key_pos, scale,
                                      sliding_window, alibi_slopes, logits_soft_cap))
    # --8<-- [start:merge]
    m_all = np.stack([m for m, _, _ in partials])  # [blocks, n, kv, g]
    m = m_all.max(axis=0)  # finite: every query sees at least its own key
    weights = np.exp(m_all - m)  # e^{m_j - m}; 0 for blocks a query does not see
    l = sum(w * l_j for w, (_, l_j, _) in zip(weights, partials))
    o = sum(w[..., None] * o_j for w, (_, _, o_j) in zip(weights, partials))
    return (o / l[..., None]).reshape(n, num_heads, head_dim)
    # --8<-- [end:merge]


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, metadata: AttentionMetadata,
                    scale: float, *, sliding_window: int | None = None, alibi_slopes: np.ndarray | None = None,
                    logits_soft_cap: float | None = None) -> np.ndarray:
    """Causal attention of every new token over its own sequence's cached context.

    Works for any mix of prefill chunks and decode tokens, and for MHA, GQA and MQA (query heads are a
    multiple of KV heads). New K/V must already be written with `write_kv`. Shapes:

        q, out          [num_tokens, num_heads, head_dim]      the batch's new tokens
        k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]   one layer
        alibi_slopes    [num_heads]                            None: no ALiBi
        logits_soft_cap                                        None: no soft cap
    """
    out = np.empty_like(q)
    starts = metadata.query_start_loc
    for i, (seq_len, table) in enumerate(zip(metadata.seq_lens, metadata.block_tables)):
        start, end = starts[i], starts[i + 1]
        out[start:end] = _attend_sequence(q[start:end], k_cache, v_cache, table, int(seq_len), scale,
                                          sliding_window, alibi_slopes, logits_soft_cap)
    return out


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, *,
                    sliding_window: int | None = None, alibi_slopes: np.ndarray | None = None,
                    logits_soft_cap: float | None = None) -> np.ndarray:
    """Plain causal softmax attention for one sequence, the textbook formula, for checking.

    q [n, num_heads, d] holds the sequence's last n positions; k and v [seq_len, num_kv_heads, d] all of it.
    """
    n, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [seq_len, heads, d]
    scores = soft_cap(np.einsum("nhd,thd->hnt", q, k) * scale, logits_soft_cap)
    query_pos, key_pos = np.arange(seq_len - n, seq_len), np.arange(seq_len)
    if alibi_slopes is not None:
        scores = scores + _alibi_bias(alibi_slopes, query_pos, key_pos).transpose(1, 0, 2)
    scores = np.where(_visible_keys(query_pos, key_pos, sliding_window)[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hnt,thd->nhd", probs, v)
