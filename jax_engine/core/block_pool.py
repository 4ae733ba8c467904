"""Physical KV blocks as parallel lists of ints: ref counts, hashes, an O(1) LRU free queue."""

from collections import OrderedDict

from reference.block_pool import BlockHash


class BlockPool:
    """`num_blocks` blocks; freed blocks keep their hash until reallocated (LRU eviction)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # OrderedDict: O(1) pop from the head, append at the tail and removal from the middle.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> int:
        assert self.free_queue, "allocate() called with no free block: check num_free_blocks first"
        block, _ = self.free_queue.popitem(last=False)
        assert self.ref_cnt[block] == 0, f"block {block} is in the free queue with ref_cnt {self.ref_cnt[block]}"
        if self.block_hash[block] is not None:  # evict the least recently freed cached block
            del self.cached_blocks[self.block_hash[block]]
            self.block_hash[block] = None
        self.ref_cnt[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.ref_cnt[block] == 0:
            del self.free_queue[block]
        self.ref_cnt[block] += 1

    def free(self, block: int) -> None:
        assert self.ref_cnt[block] > 0, f"double free of block {block}"
        self.ref_cnt[block] -= 1
        if self.ref_cnt[block] == 0:
            self.free_queue[block] = None

    def cache(self, block: int, block_hash: BlockHash) -> None:
        assert self.ref_cnt[block] > 0, f"caching unheld block {block}"
        if self.block_hash[block] is None and block_hash not in self.cached_blocks:
            self.block_hash[block] = block_hash
            self.cached_blocks[block_hash] = block

    def forget_cached_blocks(self) -> None:
        self.cached_blocks.clear()
        self.block_hash = [None] * self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)
