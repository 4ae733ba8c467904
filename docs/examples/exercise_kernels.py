"""Answers to page 8's exercises, from the reference's block manager and attention."""

import numpy as np

from reference import AttentionMetadata, BlockManager, paged_attention, write_kv

seq_lens = [5, 19, 33]  # three sequences' context lengths, as in the kernel example

# 1. How many blocks does a kernel read for each sequence, and how many slots lie
#    reserved but empty, at each block size?
for block_size in (8, 16, 64, 128):
    bm = BlockManager(num_blocks=32, block_size=block_size)
    for i, n in enumerate(seq_lens):
        bm.allocate(f"s{i}", list(range(n)))
    tables = [bm.block_table(f"s{i}") for i in range(len(seq_lens))]
    reads = [len(t) for t in tables]
    empty = sum(len(t) * block_size - n for t, n in zip(tables, seq_lens))
    print(f"1. block_size {block_size:3}: blocks read {reads}, empty slots {empty}")

# 2. The same keys and values in blocks laid out in order, then scattered over
#    the cache: does the output change?
BLOCK, KV_HEADS, HEADS, DIM = 8, 2, 6, 16
rng = np.random.default_rng(0)
k = rng.normal(size=(33, KV_HEADS, DIM))  # one 33-token sequence, 5 blocks
v = rng.normal(size=(33, KV_HEADS, DIM))
q = rng.normal(size=(1, HEADS, DIM))  # its decode query


def attend(table: list[int]) -> np.ndarray:
    k_cache = np.zeros((16, BLOCK, KV_HEADS, DIM))
    v_cache = np.zeros((16, BLOCK, KV_HEADS, DIM))
    pos = np.arange(33)
    slots = np.array(table)[pos // BLOCK] * BLOCK + pos % BLOCK  # the slot formula
    write_kv(k_cache, v_cache, k, v, slots)
    md = AttentionMetadata(np.array([0]), np.array([0, 1]), np.array([33]), [table])
    return paged_attention(q, k_cache, v_cache, md, DIM**-0.5)


same = np.array_equal(attend([0, 1, 2, 3, 4]), attend([13, 2, 9, 0, 6]))
print(f"2. in order vs scattered: bit for bit equal: {same}")

# 3. A decode kernel splits the 5 blocks into 2 partitions of 3 and 2 blocks and
#    merges them by log-sum-exp. Does that equal attention over all 5 at once?
def partial(first: int, last: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(o, m, l) over blocks first..last-1, unnormalized, as one partition has them."""
    kk = np.repeat(k[first * BLOCK:last * BLOCK], HEADS // KV_HEADS, axis=1)
    vv = np.repeat(v[first * BLOCK:last * BLOCK], HEADS // KV_HEADS, axis=1)
    s = np.einsum("hd,thd->ht", q[0], kk) * DIM**-0.5
    m = s.max(axis=1)
    p = np.exp(s - m[:, None])
    return np.einsum("ht,thd->hd", p, vv), m, p.sum(axis=1)


(o1, m1, l1), (o2, m2, l2) = partial(0, 3), partial(3, 5)
m = np.maximum(m1, m2)
w1, w2 = np.exp(m1 - m), np.exp(m2 - m)
merged = (w1[:, None] * o1 + w2[:, None] * o2) / (w1 * l1 + w2 * l2)[:, None]
diff = np.abs(merged - attend([0, 1, 2, 3, 4])[0]).max()
assert diff < 1e-12
print("3. two partitions merged vs reference: max |diff| < 1e-12")
