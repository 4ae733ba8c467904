"""Answers to page 4's exercises, computed by the block manager itself."""

from reference import BlockManager

system = [101, 102, 103, 104, 105, 106, 107, 108]  # two full blocks of four tokens


def fresh() -> BlockManager:
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate("alice", system + [11, 12])  # blocks 0, 1, 2
    bm.cache_full_blocks("alice", system + [11, 12], num_computed_tokens=10)
    bm.free("alice")
    return bm


# 1. alice (10 tokens) ran and finished. bob brings 10 new tokens:
#    which blocks does he get, and what is left cached?
bm = fresh()
bm.allocate("bob", list(range(10)))
cached = sorted(bm.device.cached_blocks.values())
print(f"1. bob gets {bm.block_table('bob')}; still cached: {cached}")

# 2. Instead, carol brings alice's system prompt and one token of her own:
#    how many tokens are found?
bm = fresh()
found = bm.allocate("carol", system + [7])
print(f"2. carol finds {found} tokens; her table {bm.block_table('carol')}")

# 3. After 2, dave brings 12 new tokens.
#    Which blocks does he get, and which hashes survive?
bm.allocate("dave", list(range(20, 32)))
cached = sorted(bm.device.cached_blocks.values())
print(f"3. dave gets {bm.block_table('dave')}; still cached: {cached}")
