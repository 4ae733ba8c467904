"""Parallel sampling: three samples share the prompt's blocks and copy one on write."""

import numpy as np

from reference import BlockManager, KVCache

bm = BlockManager(num_blocks=8, block_size=4)
kv = KVCache(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2)
prompt = list(range(100, 110))  # 10 tokens: blocks 0 and 1 full, block 2 half full
bm.allocate("sample0", prompt)  # the prompt is computed once, for all samples
kv.k[:, bm.block_table("sample0")] = np.arange(3)[None, :, None, None, None]  # its K
for child in ("sample1", "sample2"):
    bm.fork("sample0", child)  # the child's table is a copy; every block gains a holder
ref_cnt = {b: bm.device.blocks[b].ref_cnt for b in bm.block_table("sample0")}
print(f"after forking: ref_cnt {ref_cnt}")

# Each sample writes its own token at position 10, into the shared, half-full block 2.
for seq in ("sample0", "sample1", "sample2"):
    copies = bm.append_slots(seq, num_computed_tokens=10, num_new_tokens=1)
    kv.copy_blocks(copies)  # the cache copies K/V; the manager only names the blocks
    print(f"{seq} writes position 10: copies {copies}, table {bm.block_table(seq)}, "
          f"block 2 ref_cnt {bm.device.blocks[2].ref_cnt}")

tables = [bm.block_table(seq) for seq in bm.block_tables]
held, listed = len({b for t in tables for b in t}), sum(len(t) for t in tables)
print(f"{held} blocks held for {listed} table entries: {1 - held / listed:.0%} saved")
assert held == 5 and (kv.k[:, 3] == kv.k[:, 2]).all() and (kv.k[:, 4] == 2).all()
