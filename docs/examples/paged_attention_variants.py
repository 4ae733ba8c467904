"""Sliding windows and ALiBi change which keys a query sees and how it scores them;
the paged computation stays the same."""

import numpy as np

from reference import AttentionMetadata, paged_attention, write_kv
from reference.paged_attention import dense_attention

block_size, num_heads, head_dim, seq_len = 4, 2, 8, 10
table = [5, 2, 6]  # the sequence's blocks, as in the example above
rng = np.random.default_rng(0)
k = rng.standard_normal((seq_len, 1, head_dim))
v = rng.standard_normal((seq_len, 1, head_dim))
q = rng.standard_normal((1, num_heads, head_dim))  # the last token's query
positions = np.arange(seq_len)
slots = np.array(table)[positions // block_size] * block_size + positions % block_size
k_cache = np.full((8, block_size, 1, head_dim), np.nan)  # NaN where nothing is written
v_cache = np.full_like(k_cache, np.nan)
write_kv(k_cache, v_cache, k, v, slots)
metadata = AttentionMetadata(slot_mapping=slots[-1:], query_start_loc=np.array([0, 1]),
                             seq_lens=np.array([seq_len]), block_tables=[table])
scale = head_dim**-0.5

# A window of 4: position 9 sees positions 6..9, in blocks 2 and 6. Block 5 is
# never read: poison it, and the result does not change.
k_cache[5], v_cache[5] = np.nan, np.nan
windowed = paged_attention(q, k_cache, v_cache, metadata, scale, sliding_window=4)
expected = dense_attention(q, k, v, scale, sliding_window=4)
print(f"window 4: max |paged - dense| = {np.abs(windowed - expected).max():.1e}")
write_kv(k_cache, v_cache, k, v, slots)  # block 5 back

# ALiBi: head h adds slope[h] * (t - p) to its scores, so far keys weigh less.
slopes = np.array([2.0, 0.25])  # a steep head and a gentle one
alibi = paged_attention(q, k_cache, v_cache, metadata, scale, alibi_slopes=slopes)
expected = dense_attention(q, k, v, scale, alibi_slopes=slopes)
print(f"ALiBi: max |paged - dense| = {np.abs(alibi - expected).max():.1e}")
for h, slope in enumerate(slopes):
    distance = positions - (seq_len - 1)  # t - p: 0 for the query's own key
    scores = k[:, 0] @ q[0, h] * scale + slope * distance
    weights = np.exp(scores - scores.max())
    weights /= weights.sum()
    print(f"head {h} (slope {slope}): weight on the last 3 keys "
          f"{weights[-3:].sum():.2f}")
