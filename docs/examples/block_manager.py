"""The block manager at work: free queue, reference counts, prefix-cache index."""

from reference import BlockManager, hash_block_tokens

bm = BlockManager(num_blocks=10, block_size=4)
pool = bm.device  # the BlockPool: blocks, free queue, hash index


def show(event: str) -> None:
    tables = "  ".join(f"{seq} {bm.block_table(seq)}" for seq in bm.block_tables)
    shared = {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt > 1}
    queue, cached = list(pool.free_queue), sorted(pool.cached_blocks.values())
    print(f"{event}\n  tables: {tables or '-'}")
    print(f"  ref_cnt > 1: {shared}  free queue {queue}  cached {cached}")


system = [101, 102, 103, 104, 105, 106, 107, 108]  # a system prompt: two full blocks
alice = system + [11, 12, 13, 14]
bm.allocate("alice", alice)
bm.cache_full_blocks("alice", alice, num_computed_tokens=12)  # once her prefill ran
show("alice: 12 tokens, 3 blocks from the head of the queue, hashed once computed")

bm.free("alice")
show("alice finishes: her blocks go to the tail, last block first, hashes kept")

bm.allocate("bob", list(range(16)))
bm.allocate("carol", list(range(50, 66)))
show("bob and carol: 16 new tokens each; carol's last block evicts alice's third")

bm.free("bob")
show("bob finishes: his blocks join the tail")

cached = bm.allocate("dave", system + [21, 22])
show(f"dave: same system prompt: {cached} tokens found by hash, blocks 0 and 1 revived")

cached = bm.allocate("erin", system + [31])
show(f"erin: {cached} tokens found by hash; blocks 0 and 1 now have 2 holders")

h0, h1 = pool.blocks[0].block_hash, pool.blocks[1].block_hash
print(f"block 0: hash {h0.hex()[:16]}...  block 1: hash {h1.hex()[:16]}...")
assert h0 == hash_block_tokens(None, system[:4])  # the first block has no parent
assert h1 == hash_block_tokens(h0, system[4:])  # chained: the parent's hash goes in
assert bm.block_table("dave")[:2] == bm.block_table("erin")[:2] == [0, 1]
assert pool.blocks[0].ref_cnt == 2 and pool.blocks[2].block_hash is None
