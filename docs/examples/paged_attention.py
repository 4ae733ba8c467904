"""PagedAttention over a scattered block table equals dense attention."""

import numpy as np

from reference import AttentionMetadata, BlockManager, paged_attention, write_kv
from reference.paged_attention import dense_attention

block_size, num_blocks = 4, 8
num_heads, num_kv_heads, head_dim = 3, 1, 8  # 3 query heads share 1 KV head (GQA)
words = "Four score and seven years ago our fathers brought forth".split()

# Eight requests fill the cache; three finish and free their blocks as they end.
bm = BlockManager(num_blocks, block_size)
for r in range(8):
    bm.allocate(f"r{r}", [r] * block_size)
for r in (5, 2, 6):
    bm.free(f"r{r}")
bm.allocate("speech", list(range(len(words))))  # 10 tokens: 3 blocks, one half full
table = bm.block_table("speech")
print("block table:", table)

positions = np.arange(len(words))
slots = np.array(table)[positions // block_size] * block_size + positions % block_size
for p in (0, 3, 4, 9):
    logical, offset = p // block_size, p % block_size
    print(f"position {p} {words[p]!r:>9}: logical block {logical}, offset {offset}"
          f" -> physical block {table[logical]}, slot {slots[p]}")

rng = np.random.default_rng(0)
k = rng.standard_normal((len(words), num_kv_heads, head_dim))  # [tokens, kv_heads, dim]
v = rng.standard_normal((len(words), num_kv_heads, head_dim))
q = rng.standard_normal((1, num_heads, head_dim))  # the last token's query (decode)
k_cache = np.zeros((num_blocks, block_size, num_kv_heads, head_dim))
v_cache = np.zeros_like(k_cache)
write_kv(k_cache, v_cache, k, v, slots)

scale = head_dim**-0.5
metadata = AttentionMetadata(slot_mapping=slots[-1:], query_start_loc=np.array([0, 1]),
                             seq_lens=np.array([len(words)]), block_tables=[table])
paged = paged_attention(q, k_cache, v_cache, metadata, scale)  # [1, heads, dim]
dense = dense_attention(q, k, v, scale)
print(f"max |paged - dense| = {np.abs(paged - dense).max():.1e}")

# Query head 0 by hand, block by block: a max, a sum of exponentials and a weighted
# sum of values per block; then one merge, each block rescaled to the common max.
m, ell, o = [], [], []
for j, block in enumerate(table):
    valid = min(block_size, len(words) - j * block_size)  # the last block is part full
    scores = k_cache[block, :valid, 0] @ q[0, 0] * scale  # [valid]
    m.append(scores.max())
    ell.append(np.exp(scores - m[-1]).sum())
    o.append(np.exp(scores - m[-1]) @ v_cache[block, :valid, 0])  # [dim]
    print(f"block {block}: m = {m[-1]:+.3f}, l = {ell[-1]:.3f}")
weights = np.exp(np.array(m) - max(m))
merged = (weights @ np.array(o)) / (weights @ np.array(ell))
diff = np.abs(merged - paged[0, 0]).max()
print(f"merged by hand: max |merged - paged| = {diff:.1e}")
assert np.allclose(paged, dense) and np.allclose(merged, paged[0, 0])
assert sorted(table) != table  # the blocks really are out of order
