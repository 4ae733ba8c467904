"""Physical KV blocks: reference counts, the free queue, and the prefix-cache index.

A *physical block* holds the keys and values of `block_size` consecutive tokens. Like a page frame in an
operating system, it is shared by reference counting and recycled through a free list:

    free_queue (eviction order)        cached_blocks (prefix-cache index)
    head -> [7] [3] [9] ... <- tail     block_hash -> block_id
             ^ evicted first              (only full blocks whose tokens were computed)

A block whose `ref_cnt` drops to zero goes to the tail of the free queue but *keeps* its hash, so a later
request with the same prefix can take it back (a prefix-cache hit). Only when the queue hands the block out
to new tokens is its hash dropped: that is LRU eviction.
"""

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

BlockHash = NewType("BlockHash", bytes)


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: it names the block's tokens *and* everything before them.

    Two blocks get the same hash only if their whole prefixes are equal, so a hash hit is safe to reuse.
    """
    # --8<-- [start:hash_block_tokens]
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return BlockHash(digest.digest())
    # --8<-- [end:hash_block_tokens]


def salt_hash(cache_salt: str | None, lora_name: str | None = None) -> BlockHash | None:
    """The parent hash of a salted request's first block (None without a salt or a LoRA adapter).

    A salt starts the chain from its own root, so blocks of different salts never share a hash: tenants
    who do not share a salt cannot hit, or time, each other's cached prefixes (vLLM's `cache_salt`). A LoRA
    adapter roots its requests' chains too: its K and V differ from the base model's for the same tokens.
    """
    if cache_salt is None and lora_name is None:
        return None
    digest = hashlib.sha256(b"cache_salt:")
    for field in (cache_salt, lora_name):  # each length-prefixed, so no salt can pose as an adapter's root
        encoded = b"" if field is None else field.encode("utf-8", "surrogatepass")
        digest.update(b"-" if field is None else b"+%d:" % len(encoded) + encoded)
    return BlockHash(digest.digest())


@dataclass
class Block:
    """One physical block. `block_hash` is set only while the block is in the prefix cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """A fixed set of physical blocks with a free queue in eviction (LRU) order."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        # An OrderedDict is a queue that also removes from the middle in O(1) (a prefix-cache hit
        # takes a free block back out of the queue).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[BlockHash, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out, including cached blocks nobody holds (evictable)."""
        return len(self.free_queue)

    def allocate(self) -> Block:
        """Take the least recently freed block, evicting its cached contents if it has any."""
        assert self.free_queue, "allocate() called with no free block: check num_free_blocks first"
        block = self.blocks[self.free_queue.popitem(last=False)[0]]
        assert block.ref_cnt == 0, f"block {block.block_id} is in the free queue with ref_cnt {block.ref_cnt}"
        if block.block_hash is not None:
            del self.cached_blocks[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def share(self, block: Block) -> None:
        """Add a holder: a prefix-cache hit or a fork. A free cached block leaves the free queue."""
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    # --8<-- [start:free_queue]
    def free(self, block: Block) -> None:
        """Drop a holder; at zero the block joins the free queue's tail (evicted last)."""
        assert block.ref_cnt > 0, f"double free of block {block.block_id}"
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue[block.block_id] = None
    # --8<-- [end:free_queue]

    def lookup(self, block_hash: BlockHash) -> Block | None:
        block_id = self.cached_blocks.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def cache(self, block: Block, block_hash: BlockHash) -> None:
        """Index a full, computed block by its hash, unless an identical block is already indexed."""
        assert block.ref_cnt > 0, f"caching unheld block {block.block_id}"
        if block.block_hash is None and block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block.block_id
