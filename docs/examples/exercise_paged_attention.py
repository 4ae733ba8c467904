"""Answers to page 3's exercises, computed with the reference's own objects."""

import numpy as np

from reference import AttentionMetadata, BlockManager, paged_attention, write_kv
from reference.paged_attention import _attend_block

block_size, seq_len, head_dim = 4, 10, 8
bm = BlockManager(num_blocks=8, block_size=block_size)
for r in range(8):  # the example's cache: eight requests, then 5, 2 and 6 finish
    bm.allocate(f"r{r}", [r] * block_size)
for r in (5, 2, 6):
    bm.free(f"r{r}")
bm.allocate("speech", list(range(seq_len)))
table = bm.block_table("speech")

# 1. Where do positions 6 and 8 live?
positions = np.arange(seq_len)
slots = np.array(table)[positions // block_size] * block_size + positions % block_size
print(f"1. table {table}: position 6 -> slot {slots[6]}, position 8 -> slot {slots[8]}")

# 2. The last block holds two tokens whose keys are zero vectors. What are its
#    m, l and o for any query?
rng = np.random.default_rng(0)
k = rng.standard_normal((seq_len, 1, head_dim))
v = rng.standard_normal((seq_len, 1, head_dim))
k[8:] = 0.0
q = rng.standard_normal((1, 1, 1, head_dim))  # [n, kv heads, group, dim]
m, l, o = _attend_block(q, k[8:], v[8:], np.array([9]), np.array([8, 9]),
                        head_dim**-0.5, None, None)
print(f"2. m = {m.item():.1f}, l = {l.item():.1f}, "
      f"o = v8 + v9: {np.allclose(o[0, 0, 0], v[8, 0] + v[9, 0])}")

# 3. Scale the query by 1000 and compute Eq. 4 as printed (no maximum taken
#    out). What do Eq. 4 and paged_attention give?
k_cache = np.zeros((8, block_size, 1, head_dim))
v_cache = np.zeros_like(k_cache)
write_kv(k_cache, v_cache, k, v, slots)
q = 1000 * rng.standard_normal((1, 1, head_dim))
metadata = AttentionMetadata(slots[-1:], np.array([0, 1]), np.array([seq_len]), [table])
paged = paged_attention(q, k_cache, v_cache, metadata, head_dim**-0.5)
with np.errstate(over="ignore", invalid="ignore"):
    e = np.exp(k[:, 0] @ q[0, 0] * head_dim**-0.5)  # exp(q K / sqrt(d)), every key
    eq4 = (e / e.sum()) @ v[:, 0]
print(f"3. Eq. 4 as printed: {eq4[:2].round(3)} ...; "
      f"paged_attention: {paged[0, 0, :2].round(3)} ...")
