"""Two requests share a system prompt's blocks; a fork shares everything and copies on write."""

from reference import BlockManager

bm = BlockManager(num_blocks=8, block_size=4)
system_prompt = [101, 102, 103, 104, 105, 106, 107, 108]  # two full blocks

bm.allocate("alice", system_prompt + [1, 2])
bm.cache_full_blocks("alice", system_prompt + [1, 2], num_computed_tokens=10)  # after her prefill
cached = bm.allocate("bob", system_prompt + [3])
print("alice:", bm.block_table("alice"), " bob:", bm.block_table("bob"), f" bob reused {cached} tokens")
assert bm.block_table("bob")[:2] == bm.block_table("alice")[:2] and cached == 8

bm.fork("alice", "alice-2")  # parallel sampling: a second sample shares all of alice's blocks
copies = bm.append_slots("alice-2", num_computed_tokens=10, num_new_tokens=1)
print("alice-2 copies its partial last block before writing:", copies, "->", bm.block_table("alice-2"))
assert copies == [(bm.block_table("alice")[2], bm.block_table("alice-2")[2])]
