"""Automatic prefix caching: full blocks are found by a chained hash of their tokens."""

from reference import BlockManager, hash_block_tokens
from reference.block_pool import salt_hash

bm = BlockManager(num_blocks=10, block_size=4)
system = [101, 102, 103, 104, 105, 106, 107, 108]  # a system prompt: two full blocks
h0 = hash_block_tokens(None, system[:4])  # the first block has no parent
h1 = hash_block_tokens(h0, system[4:])  # the second block's hash covers the first too
print(f"system prompt blocks: hash {h0.hex()[:8]} -> hash {h1.hex()[:8]}")

alice = system + [11, 12, 13]
bm.allocate("alice", alice)
bm.cache_full_blocks("alice", alice, num_computed_tokens=len(alice))  # once computed
requests = {
    "bob": system + [21, 22, 23],  # the same system prompt, another question
    "carol": [201, 202, 203, 204] + system[4:] + [31],  # same 2nd block, other 1st
    "dave": system,  # exactly the system prompt: its last token is always computed
}
for name, tokens in requests.items():
    cached = bm.allocate(name, tokens)
    print(f"{name}: {len(tokens)} tokens, {cached} found in the cache, "
          f"table {bm.block_table(name)}")
    bm.cache_full_blocks(name, tokens, num_computed_tokens=len(tokens))

salted = hash_block_tokens(salt_hash("tenant-a"), system[:4])
print(f"with cache_salt 'tenant-a' the first block hashes to {salted.hex()[:8]}, "
      f"not {h0.hex()[:8]}")
assert bm.block_table("bob")[:2] == bm.block_table("alice")[:2]
assert bm.block_table("carol")[1] != bm.block_table("alice")[1] and salted != h0
