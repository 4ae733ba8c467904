"""The block manager: per-sequence block tables over a pool of physical blocks.

Each sequence sees its KV cache as a list of *logical* blocks; its block table maps them to physical
blocks, exactly like a page table maps virtual pages to page frames:

    token position p  ->  logical block p // block_size, offset p % block_size
    slot = block_table[p // block_size] * block_size + p % block_size

The manager owns a device pool (where attention reads) and a host pool (where swapped-out sequences wait).
It never touches K/V values: it returns the copies the cache must perform (copy-on-write, swap out/in).
"""

from collections.abc import Sequence

from reference.block_pool import Block, BlockHash, BlockPool, hash_block_tokens


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates, shares, swaps and frees KV blocks for sequences identified by `seq_id`.

    Args:
        num_blocks: physical blocks in the device pool, where attention reads.
        block_size: tokens per block.
        num_host_blocks: blocks in the host pool that swapped-out sequences move to (0: no swapping).
        enable_prefix_caching: find full blocks again by their chained hash, and reuse them.

    Raises:
        ValueError: a pool or block size out of range.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        if num_blocks < 1 or block_size < 1 or num_host_blocks < 0:
            raise ValueError(
                f"need num_blocks >= 1, block_size >= 1, num_host_blocks >= 0; got "
                f"{num_blocks}, {block_size}, {num_host_blocks}"
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.device = BlockPool(num_blocks)
        self.host = BlockPool(num_host_blocks)
        self.block_tables: dict[str, list[Block]] = {}
        self.swapped_out: set[str] = set()  # sequences whose table points into the host pool
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # tokens found there

    # ----------------------------------------------------------------------------------- queries
    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens: the last one may be partly filled.

        Args:
            num_tokens: tokens of one sequence.

        Returns:
            `ceil(num_tokens / block_size)`.
        """
        return cdiv(num_tokens, self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        """The sequence's block table: the physical block id of each of its logical blocks, in order.

        Args:
            seq_id: a sequence that holds blocks (allocated or forked, not yet freed).

        Returns:
            Block ids, in the device pool or, while the sequence is swapped out, in the host pool.
        """
        return [block.block_id for block in self.block_tables[seq_id]]

    def _full_block_hashes(self, token_ids: Sequence[int], num_blocks: int) -> list[BlockHash]:
        hashes: list[BlockHash] = []
        for i in range(num_blocks):
            chunk = token_ids[i * self.block_size : (i + 1) * self.block_size]
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, chunk))
        return hashes

    def find_cached_prefix(self, token_ids: Sequence[int], *, read_cache: bool = True) -> list[Block]:
        """The longest run of leading full blocks already in the prefix cache.

        NOTE: the last token is never taken from the cache: its logits are needed to sample the next
        token, so at least one token is always computed.

        Args:
            token_ids: a prompt (or a preempted sequence's prompt and output so far).
            read_cache: False for a request that must compute every token (one asking for prompt
                logprobs): it gets no hits, though its own full blocks are still cached for others.

        Returns:
            The cached device blocks that hold its first tokens, in order; empty when prefix caching
            is off. Nothing is reserved: `allocate` takes them.
        """
        if not self.enable_prefix_caching or not read_cache:
            return []
        hits = []
        for block_hash in self._full_block_hashes(token_ids, (len(token_ids) - 1) // self.block_size):
            block = self.device.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    # -------------------------------------------------------------------- allocation and growth
    def can_allocate(self, token_ids: Sequence[int], *, read_cache: bool = True) -> bool:
        """Whether `allocate` would find enough free device blocks for a new sequence of these tokens.

        Args:
            token_ids: the tokens the new sequence starts with.
            read_cache: see `find_cached_prefix`.

        Returns:
            True if its blocks, less those found in the prefix cache, fit in the free device blocks.
        """
        hits = self.find_cached_prefix(token_ids, read_cache=read_cache)
        # A hit on a free cached block takes it out of the free queue, so it costs a free block too.
        needed = self.num_blocks_for(len(token_ids)) - len(hits) + sum(b.ref_cnt == 0 for b in hits)
        return needed <= self.device.num_free_blocks

    def allocate(self, seq_id: str, token_ids: Sequence[int], *, read_cache: bool = True) -> int:
        """Give a new sequence blocks for all `token_ids`, reusing cached prefix blocks.

        Args:
            seq_id: the new sequence; it must not hold blocks yet.
            token_ids: its tokens; `can_allocate(token_ids)` must be true.
            read_cache: see `find_cached_prefix`.

        Returns:
            The number of leading tokens whose K/V are already in the cache (num_cached_tokens).
        """
        assert seq_id not in self.block_tables, f"sequence {seq_id!r} already has blocks"
        assert self.can_allocate(token_ids, read_cache=read_cache), f"not enough free blocks for sequence {seq_id!r}"
        hits = self.find_cached_prefix(token_ids, read_cache=read_cache)
        for block in hits:
            self.device.share(block)
        fresh = [self.device.allocate() for _ in range(self.num_blocks_for(len(token_ids)) - len(hits))]
        self.block_tables[seq_id] = hits + fresh
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(token_ids)
            self.prefix_cache_hits += len(hits) * self.block_size
        return len(hits) * self.block_size

    def _writes_shared_block(self, seq_id: str, num_computed_tokens: int) -> bool:
        """Will the next token land in a partially filled last block that another sequence holds?"""
        table = self.block_tables[seq_id]
        return num_computed_tokens < len(table) * self.block_size and table[-1].ref_cnt > 1

    def num_blocks_to_append(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Free device blocks needed to write `num_new_tokens` more tokens (copy-on-write included).

        Args:
            seq_id: a sequence on the device.
            num_computed_tokens: tokens whose K/V are already written.
            num_new_tokens: tokens the next step writes after them.

        Returns:
            New blocks to append, plus one if its partially filled last block is shared and must be
            copied before the write.
        """
        table = self.block_tables[seq_id]
        new = max(0, self.num_blocks_for(num_computed_tokens + num_new_tokens) - len(table))
        return new + self._writes_shared_block(seq_id, num_computed_tokens)

    def can_append_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Whether `append_slots` would find the free device blocks it needs.

        Args:
            seq_id: a sequence on the device.
            num_computed_tokens: tokens whose K/V are already written.
            num_new_tokens: tokens the next step writes after them.

        Returns:
            True if `num_blocks_to_append(...)` blocks are free.
        """
        needed = self.num_blocks_to_append(seq_id, num_computed_tokens, num_new_tokens)
        return needed <= self.device.num_free_blocks

    def append_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for tokens at positions [num_computed_tokens, num_computed_tokens + num_new_tokens).

        Args:
            seq_id: a sequence on the device.
            num_computed_tokens: tokens whose K/V are already written.
            num_new_tokens: tokens the next step writes after them; `can_append_slots` must be true.

        Returns:
            Copy-on-write copies (src_block, dst_block): if the partially filled last block is shared
            (after a fork), this sequence gets a private copy before writing to it.
        """
        assert self.can_append_slots(seq_id, num_computed_tokens, num_new_tokens), "out of blocks"
        table = self.block_tables[seq_id]
        copies = []
        if self._writes_shared_block(seq_id, num_computed_tokens):
            shared, private = table[-1], self.device.allocate()
            self.device.free(shared)
            table[-1] = private
            copies.append((shared.block_id, private.block_id))
        while len(table) < self.num_blocks_for(num_computed_tokens + num_new_tokens):
            table.append(self.device.allocate())
        return copies

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Enter the sequence's full, computed blocks into the prefix cache.

        Does nothing when prefix caching is off or the sequence is swapped out (its blocks are in the
        host pool, where nobody looks them up).

        Args:
            seq_id: a sequence that holds blocks.
            token_ids: all its tokens so far; each full block's hash chains over them.
            num_computed_tokens: tokens whose K/V are written; only blocks full of those are cached.
        """
        if not self.enable_prefix_caching or seq_id in self.swapped_out:
            return
        num_full = num_computed_tokens // self.block_size
        table = self.block_tables[seq_id]
        for block, block_hash in zip(table[:num_full], self._full_block_hashes(token_ids, num_full)):
            self.device.cache(block, block_hash)

    # --------------------------------------------------------------------------- sharing and freeing
    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (parallel sampling, beam search).

        Each block's `ref_cnt` goes up by one; no block is copied until one of them writes into a
        shared, partially filled block (copy-on-write, in `append_slots`).

        Args:
            parent_id: a sequence on the device.
            child_id: a new sequence id that holds no blocks yet.
        """
        assert child_id not in self.block_tables, f"sequence {child_id!r} already has blocks"
        assert parent_id not in self.swapped_out, f"cannot fork swapped-out sequence {parent_id!r}"
        for block in self.block_tables[parent_id]:
            self.device.share(block)
        self.block_tables[child_id] = list(self.block_tables[parent_id])

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks, tail first, so its tail is evicted before its prefix.

        A block goes back to the free queue when its last holder frees it; a cached block stays
        findable by its hash until the free queue hands it out again.

        Args:
            seq_id: a sequence that holds blocks, on the device or swapped out.
        """
        pool = self.host if seq_id in self.swapped_out else self.device
        for block in reversed(self.block_tables.pop(seq_id)):
            pool.free(block)
        self.swapped_out.discard(seq_id)

    # ---------------------------------------------------------------------------------- swapping
    def _distinct_blocks(self, seq_ids: Sequence[str]) -> list[Block]:
        seen: dict[int, Block] = {}
        for seq_id in seq_ids:
            seen.update((b.block_id, b) for b in self.block_tables[seq_id])
        return list(seen.values())

    def can_swap_out(self, seq_ids: Sequence[str]) -> bool:
        """Whether the host pool has a free block for every distinct block of the group.

        Args:
            seq_ids: a sequence group (a request's parallel samples or beams), all on the device.

        Returns:
            True if `swap_out(seq_ids)` would fit; blocks shared inside the group count once.
        """
        return len(self._distinct_blocks(seq_ids)) <= self.host.num_free_blocks

    def can_swap_in(self, seq_ids: Sequence[str], num_extra_blocks: int = 0) -> bool:
        """Whether the device pool has a free block for every distinct block of the group, and more.

        Args:
            seq_ids: a swapped-out sequence group.
            num_extra_blocks: blocks the group will need right after (for the step's new tokens).

        Returns:
            True if the group's blocks, counted once each, plus `num_extra_blocks` are free.
        """
        return len(self._distinct_blocks(seq_ids)) + num_extra_blocks <= self.device.num_free_blocks

    def swap_out(self, seq_ids: Sequence[str]) -> dict[int, int]:
        """Move a sequence group's blocks to the host pool; the group is swapped out.

        The whole group moves together (vLLM's all-or-nothing eviction of a sequence group), and blocks
        shared inside it stay shared in the host pool.

        Args:
            seq_ids: a sequence group on the device; `can_swap_out(seq_ids)` must be true.

        Returns:
            The copies the KV cache must make, `{device_block: host_block}`.
        """
        assert self.can_swap_out(seq_ids), "not enough host blocks to swap out"
        return self._move(seq_ids, src=self.device, dst=self.host, swapped=True)

    def swap_in(self, seq_ids: Sequence[str]) -> dict[int, int]:
        """Bring a swapped-out group back to the device pool, blocks shared inside it still shared.

        Args:
            seq_ids: a swapped-out sequence group; `can_swap_in(seq_ids)` must be true.

        Returns:
            The copies the KV cache must make, `{host_block: device_block}`.
        """
        assert self.can_swap_in(seq_ids), "not enough device blocks to swap in"
        return self._move(seq_ids, src=self.host, dst=self.device, swapped=False)

    def _move(self, seq_ids: Sequence[str], src: BlockPool, dst: BlockPool, swapped: bool) -> dict[int, int]:
        # Blocks shared inside the group move once and stay shared: one destination block per source.
        mapping: dict[int, Block] = {}
        for seq_id in seq_ids:
            assert (seq_id in self.swapped_out) != swapped, f"sequence {seq_id!r} is already there"
            new_table = []
            for block in self.block_tables[seq_id]:
                if block.block_id in mapping:
                    dst.share(mapping[block.block_id])
                else:
                    mapping[block.block_id] = dst.allocate()
                new_table.append(mapping[block.block_id])
                src.free(block)
            self.block_tables[seq_id] = new_table
            (self.swapped_out.add if swapped else self.swapped_out.discard)(seq_id)
        return {src_id: block.block_id for src_id, block in mapping.items()}
