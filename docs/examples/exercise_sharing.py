"""Answers to page 5's exercises, computed by the block manager itself."""

from reference import BlockManager

bm = BlockManager(num_blocks=8, block_size=4)
bm.allocate("s0", [1, 2, 3, 4, 5, 6])  # 6 tokens: block 0 full, block 1 half full
for child in ("s1", "s2"):
    bm.fork("s0", child)


def ref_cnts() -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in bm.device.blocks if b.ref_cnt}


# 1. After the forks: which blocks are held, by how many sequences?
print(f"1. after forking: ref_cnt {ref_cnts()}")

# 2. Each sample writes its first token (position 6): s2 first, then s0, then s1.
for seq in ("s2", "s0", "s1"):
    copies = bm.append_slots(seq, num_computed_tokens=6, num_new_tokens=1)
    print(f"2. {seq} writes position 6: copies {copies}, table {bm.block_table(seq)}")
print(f"   ref_cnt {ref_cnts()}")

# 3. s1 finishes. Which blocks join the free queue?
before = list(bm.device.free_queue)
bm.free("s1")
joined = [b for b in bm.device.free_queue if b not in before]
print(f"3. s1 frees {joined}; free queue {list(bm.device.free_queue)}; "
      f"ref_cnt {ref_cnts()}")
