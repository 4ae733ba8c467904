"""Answers to page 9's exercises, from the reference's KV cache and attention."""

import numpy as np

from reference import AttentionMetadata, KVCache, paged_attention, write_kv

HEADS, KV_HEADS, DIM = 9, 3, 8  # SmolLM2's heads, head dim shrunk
GROUP = HEADS // KV_HEADS  # query head h reads KV head h // GROUP

# 1. Deal the 9 query heads to 3 devices round-robin (0, 3, 6 to device 0, ...)
#    instead of by group. How many KV heads must each device hold?
for name, deal in (("by group", lambda d: range(d * GROUP, (d + 1) * GROUP)),
                   ("round-robin", lambda d: range(d, HEADS, 3))):
    reads = [sorted({h // GROUP for h in deal(d)}) for d in range(3)]
    print(f"1. {name:<11}: KV heads each device reads {reads}")

# 2. One 1 GiB budget per device, SmolLM2's cache (30 layers, 3 KV heads of 64,
#    16-token blocks, float16). How many blocks fit on each device at tp = 1, 3, 6?
for tp in (1, 3, 6):
    kv_heads = max(1, KV_HEADS // tp)  # past 3 devices a KV head is replicated
    block = KVCache(num_layers=30, num_blocks=1, block_size=16, num_kv_heads=kv_heads,
                    head_dim=64, dtype=np.float16)
    per_block = block.k.nbytes + block.v.nbytes
    print(f"2. tp = {tp}: {per_block:>7,} bytes a block, {2**30 // per_block:,} blocks")

# 3. Write a 6-token sequence through block table [3, 1] into one cache of 3 KV heads,
#    and into 3 device caches of 1 KV head each. Does device 2's attention, over its
#    own cache, equal heads 6-8 of the unsplit attention?
rng = np.random.default_rng(0)
q = rng.normal(size=(6, HEADS, DIM))
k, v = rng.normal(size=(6, KV_HEADS, DIM)), rng.normal(size=(6, KV_HEADS, DIM))
md = AttentionMetadata(np.array([12, 13, 14, 15, 4, 5]), np.array([0, 6]),
                       np.array([6]), [[3, 1]])


def attend(q, k, v):
    cache = KVCache(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=k.shape[1],
                    head_dim=DIM, dtype=np.float64)
    write_kv(cache.k[0], cache.v[0], k, v, md.slot_mapping)
    return paged_attention(q, cache.k[0], cache.v[0], md, DIM**-0.5)


full = attend(q, k, v)
device_2 = attend(q[:, 6:9], k[:, 2:3], v[:, 2:3])
diff = np.abs(device_2 - full[:, 6:9]).max()
assert diff < 1e-12
print("3. device 2 equals heads 6-8 of the unsplit layer (max |diff| < 1e-12)")
