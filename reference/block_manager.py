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

    `num_blocks` device blocks are where attention reads; `num_host_blocks` host blocks are where swapped-out
    sequences wait (0: no swapping).
    """

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1 or num_host_blocks < 0:
            raise ValueError(f"need num_blocks >= 1, block_size >= 1, num_host_blocks >= 0; got "
                             f"{num_blocks}, {block_size}, {num_host_blocks}")
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
        """Blocks needed to hold `num_tokens` tokens: the last one may be partly filled."""
        return cdiv(num_tokens, self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        """The physical block id of each of the sequence's logical blocks, in order (host blocks while it is
        swapped out)."""
        return [block.block_id for block in self.block_tables[seq_id]]

    # --8<-- [start:full_block_hashes]
    def _full_block_hashes(self, token_ids: Sequence[int], count: int) -> list[BlockHash]:
        hashes: list[BlockHash] = []
        for i in range(count):
            chunk = token_ids[i * self.block_size : (i + 1) * self.block_size]
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, chunk))
        return hashes
    # --8<-- [end:full_block_hashes]

    def find_cached_prefix(self, token_ids: Sequence[int], *, read_cache: bool = True) -> list[Block]:
        """The longest run of leading full blocks already in the prefix cache; nothing is reserved.

        NOTE: the last token is never taken from the cache: its logits are needed to sample the next
        token, so at least one token is always computed. `read_cache=False` is for a request that must
        compute every token (prompt logprobs): it gets no hits, though its full blocks are still cached.
        """
        # --8<-- [start:find_cached_prefix]
        if not self.enable_prefix_caching or not read_cache:
            return []
        hits = []
        num_full = (len(token_ids) - 1) // self.block_size  # not the last token's block
        for block_hash in self._full_block_hashes(token_ids, num_full):
            block = self.device.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits
        # --8<-- [end:find_cached_prefix]

    # -------------------------------------------------------------------- allocation and growth
    def can_allocate(self, token_ids: Sequence[int], *, read_cache: bool = True) -> bool:
        """Whether `allocate` would find enough free device blocks for a new sequence of these tokens."""
        hits = self.find_cached_prefix(token_ids, read_cache=read_cache)
        # A hit on a free cached block takes it out of the free queue, so it costs a free block too.
        needed = self.num_blocks_for(len(token_ids)) - len(hits) + sum(b.ref_cnt == 0 for b in hits)
        return needed <= self.device.num_free_blocks

    def allocate(self, seq_id: str, token_ids: Sequence[int], *, read_cache: bool = True) -> int:
        """Give a new sequence blocks for all `token_ids`, reusing cached prefix blocks; returns
        num_cached_tokens, the leading tokens whose K/V are already in the cache."""
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
        """Free device blocks needed to write `num_new_tokens` more tokens: new blocks, plus one if the
        partially filled last block is shared and must be copied first."""
        table = self.block_tables[seq_id]
        new = max(0, self.num_blocks_for(num_computed_tokens + num_new_tokens) - len(table))
        return new + self._writes_shared_block(seq_id, num_computed_tokens)

    def can_append_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Whether `append_slots` would find the free device blocks it needs."""
        needed = self.num_blocks_to_append(seq_id, num_computed_tokens, num_new_tokens)
        return needed <= self.device.num_free_blocks

    def append_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for tokens at positions [num_computed_tokens, num_computed_tokens + num_new_tokens).

        Returns the copy-on-write copies (src_block, dst_block): a shared, partially filled last block (after
        a fork) is replaced by a private copy before this sequence writes to it.
        """
        # --8<-- [start:append_slots]
        assert self.can_append_slots(seq_id, num_computed_tokens, num_new_tokens), "no blocks"
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
        # --8<-- [end:append_slots]

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Enter the sequence's blocks that are full of computed tokens into the prefix cache.

        Not while it is swapped out: its blocks are in the host pool, where nobody looks them up.
        """
        if not self.enable_prefix_caching or seq_id in self.swapped_out:
            return
        num_full = num_computed_tokens // self.block_size
        table = self.block_tables[seq_id]
        for block, block_hash in zip(table[:num_full], self._full_block_hashes(token_ids, num_full)):
            self.device.cache(block, block_hash)

    # --8<-- [start:trim]
    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Roll a sequence back to its first `num_tokens` tokens: free the blocks past them,
        tail first.

        Speculative decoding reserves lookahead slots for its drafts before the step;
        the blocks that only rejected drafts were written to go back to the pool. They were
        never cached: only blocks full of verified tokens are (`cache_full_blocks` runs on
        the rolled-back count).
        """
        table = self.block_tables[seq_id]
        while len(table) > self.num_blocks_for(num_tokens):
            self.device.free(table.pop())
    # --8<-- [end:trim]

    # --------------------------------------------------------------------------- sharing and freeing
    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (parallel sampling, beam search).

        Each block's `ref_cnt` goes up by one; no block is copied until one of them writes into a
        shared, partially filled block (copy-on-write, in `append_slots`).
        """
        # --8<-- [start:fork]
        assert child_id not in self.block_tables, f"{child_id!r} already has blocks"
        assert parent_id not in self.swapped_out, f"cannot fork swapped-out {parent_id!r}"
        for block in self.block_tables[parent_id]:
            self.device.share(block)
        self.block_tables[child_id] = list(self.block_tables[parent_id])
        # --8<-- [end:fork]

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks, tail first, so its tail is evicted before its prefix.

        A block goes back to the free queue when its last holder frees it; a cached block stays
        findable by its hash until the free queue hands it out again.
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
        """Whether the host pool has a free block for every distinct block of the group (a request's parallel
        samples or beams): blocks shared inside the group count once."""
        return len(self._distinct_blocks(seq_ids)) <= self.host.num_free_blocks

    def can_swap_in(self, seq_ids: Sequence[str], num_extra_blocks: int = 0) -> bool:
        """Whether the device pool has a free block for every distinct block of the group, plus
        `num_extra_blocks` for the step's new tokens."""
        return len(self._distinct_blocks(seq_ids)) + num_extra_blocks <= self.device.num_free_blocks

    def swap_out(self, seq_ids: Sequence[str]) -> dict[int, int]:
        """Move a sequence group's blocks to the host pool; returns the copies to make, {device: host block}.

        The whole group moves together (vLLM's all-or-nothing eviction of a sequence group), and blocks
        shared inside it stay shared in the host pool.
        """
        assert self.can_swap_out(seq_ids), "not enough host blocks to swap out"
        return self._move(seq_ids, src=self.device, dst=self.host, swapped=True)

    def swap_in(self, seq_ids: Sequence[str]) -> dict[int, int]:
        """Bring a swapped-out group back, blocks shared inside it still shared; returns {host: device block}."""
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
