"""Per-sequence block tables over device and host block pools, with prefix caching and swapping.

Decisions match `reference.block_manager.BlockManager` call for call; the differences are for speed:
block hashes are computed once per full block and remembered per sequence, and tables are lists of ints.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from jax_engine.core.block_pool import BlockPool
from reference.block_manager import cdiv
from reference.block_pool import BlockHash, hash_block_tokens, salt_hash


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache's shape, decided at start-up (jax_engine/kv_cache_plan.py's plan_kv_cache); vLLM's CacheConfig."""

    num_blocks: int
    block_size: int
    num_host_blocks: int = 0
    enable_prefix_caching: bool = True


class KVCacheManager:
    """Allocates, shares, swaps and frees KV blocks for sequences identified by `seq_id`."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.device = BlockPool(num_blocks)
        self.host = BlockPool(num_host_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.block_hashes: dict[str, list[BlockHash]] = {}  # chained hashes of the full blocks so far
        self.swapped_out: set[str] = set()
        self._uncached: set[str] = set()  # sequences that must compute every token (prompt logprobs)
        # sequences that share cached blocks only with the same (salt, LoRA adapter name)
        self._cache_salts: dict[str, tuple[str | None, str | None]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @classmethod
    def from_config(cls, config: CacheConfig) -> "KVCacheManager":
        return cls(config.num_blocks, config.block_size, config.num_host_blocks, config.enable_prefix_caching)

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---------------------------------------------------------------------------- prefix cache
    def skip_reading_cache(self, seq_id: str) -> None:
        """`seq_id` computes every token (prompt logprobs need them all): it never reads cached blocks."""
        self._uncached.add(seq_id)

    def reads_cache(self, seq_id: str) -> bool:
        return self.enable_prefix_caching and seq_id not in self._uncached

    def set_cache_salt(self, seq_id: str, salt: str | None, lora_name: str | None = None) -> None:
        """Root `seq_id`'s block hashes at `salt` and its LoRA adapter: it shares cached blocks only with
        sequences of the same salt and adapter."""
        self._cache_salts[seq_id] = (salt, lora_name)

    def _hashes(self, seq_id: str, token_ids: Sequence[int], num_blocks: int) -> list[BlockHash]:
        """The first `num_blocks` chained block hashes of a sequence, each computed only once.

        A sequence's tokens are append-only, so a full block's hash never changes while it lives.
        """
        hashes = self.block_hashes.setdefault(seq_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else salt_hash(*self._cache_salts.get(seq_id, (None, None)))
            hashes.append(hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs]))
        return hashes[:num_blocks]

    def find_cached_prefix(self, seq_id: str, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached run of leading full blocks (never the last token)."""
        if not self.reads_cache(seq_id):
            return []
        hits = []
        for block_hash in self._hashes(seq_id, token_ids, (len(token_ids) - 1) // self.block_size):
            block = self.device.cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _allocation_cost(self, token_ids: Sequence[int], hits: list[int]) -> int:
        evictable_hits = sum(self.device.ref_cnt[b] == 0 for b in hits)
        return self.num_blocks_for(len(token_ids)) - len(hits) + evictable_hits

    def can_allocate(self, seq_id: str, token_ids: Sequence[int]) -> bool:
        hits = self.find_cached_prefix(seq_id, token_ids)
        return self._allocation_cost(token_ids, hits) <= self.device.num_free_blocks

    def allocate(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Blocks for all of `token_ids`, cached prefix blocks reused. Returns num_cached_tokens."""
        assert seq_id not in self.block_tables, f"sequence {seq_id!r} already has blocks"
        hits = self.find_cached_prefix(seq_id, token_ids)
        assert self._allocation_cost(token_ids, hits) <= self.device.num_free_blocks, "out of blocks"
        for block in hits:
            self.device.share(block)
        table = hits + [self.device.allocate() for _ in range(self.num_blocks_for(len(token_ids)) - len(hits))]
        self.block_tables[seq_id] = table
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(token_ids)
            self.prefix_cache_hits += len(hits) * self.block_size
        return len(hits) * self.block_size

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        if not self.enable_prefix_caching or seq_id in self.swapped_out:
            return
        num_full = num_computed_tokens // self.block_size
        hashes = self._hashes(seq_id, token_ids, num_full)
        table = self.block_tables[seq_id]
        for block, block_hash in zip(table, hashes):
            self.device.cache(block, block_hash)

    # ---------------------------------------------------------------------------------- growth
    def _writes_shared_block(self, seq_id: str, num_computed_tokens: int) -> bool:
        table = self.block_tables[seq_id]
        pool = self.host if seq_id in self.swapped_out else self.device
        return num_computed_tokens < len(table) * self.block_size and pool.ref_cnt[table[-1]] > 1

    def num_blocks_to_append(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> int:
        table = self.block_tables[seq_id]
        new = max(0, self.num_blocks_for(num_computed_tokens + num_new_tokens) - len(table))
        return new + self._writes_shared_block(seq_id, num_computed_tokens)

    def can_append_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        return self.num_blocks_to_append(seq_id, num_computed_tokens, num_new_tokens) <= self.device.num_free_blocks

    def append_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> list[tuple[int, int]]:
        """Room for tokens [num_computed, num_computed + num_new); returns copy-on-write copies."""
        assert self.can_append_slots(seq_id, num_computed_tokens, num_new_tokens), "out of blocks"
        table = self.block_tables[seq_id]
        copies = []
        if self._writes_shared_block(seq_id, num_computed_tokens):
            shared, private = table[-1], self.device.allocate()
            self.device.free(shared)
            table[-1] = private
            copies.append((shared, private))
        for _ in range(self.num_blocks_for(num_computed_tokens + num_new_tokens) - len(table)):
            table.append(self.device.allocate())
        return copies

    # --------------------------------------------------------------------------- share and free
    def fork(self, parent_id: str, child_id: str) -> None:
        assert child_id not in self.block_tables and parent_id not in self.swapped_out
        for block in self.block_tables[parent_id]:
            self.device.share(block)
        self.block_tables[child_id] = list(self.block_tables[parent_id])
        self.block_hashes[child_id] = list(self.block_hashes.get(parent_id, []))
        if parent_id in self._cache_salts:
            self._cache_salts[child_id] = self._cache_salts[parent_id]

    def free(self, seq_id: str) -> None:
        """Release blocks tail first, so a sequence's tail is evicted before its prefix."""
        pool = self.host if seq_id in self.swapped_out else self.device
        for block in reversed(self.block_tables.pop(seq_id)):
            pool.free(block)
        self.swapped_out.discard(seq_id)

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Shrink a resident sequence's table to the blocks `num_tokens` tokens need, freeing the tail blocks
        (tokens written and then rejected, as speculative decoding rejects drafts). Hashes of full blocks
        past the new length are dropped: those blocks may be written again with other tokens."""
        assert seq_id not in self.swapped_out, "trim a resident sequence"
        table, keep = self.block_tables[seq_id], self.num_blocks_for(num_tokens)
        while len(table) > keep:
            self.device.free(table.pop())
        del self.block_hashes.get(seq_id, [])[num_tokens // self.block_size:]

    def tracked_seq_ids(self) -> set[str]:
        """Every sequence the manager remembers anything of: a table, hashes, a mark or a salt."""
        return self.block_tables.keys() | self.block_hashes.keys() | self._uncached | self._cache_salts.keys()

    def forget(self, seq_id: str) -> None:
        """Drop what is remembered about a finished sequence."""
        self.block_hashes.pop(seq_id, None)
        self._uncached.discard(seq_id)
        self._cache_salts.pop(seq_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False, nothing forgotten) while a sequence holds blocks."""
        if self.block_tables:
            return False
        self.device.forget_cached_blocks()
        self.host.forget_cached_blocks()
        return True

    # --------------------------------------------------------------------------------- swapping
    def _distinct_blocks(self, seq_ids: Sequence[str]) -> set[int]:
        return {b for seq_id in seq_ids for b in self.block_tables[seq_id]}

    def can_swap_out(self, seq_ids: Sequence[str]) -> bool:
        return len(self._distinct_blocks(seq_ids)) <= self.host.num_free_blocks

    def can_swap_in(self, seq_ids: Sequence[str], num_extra_blocks: int = 0) -> bool:
        return len(self._distinct_blocks(seq_ids)) + num_extra_blocks <= self.device.num_free_blocks

    def swap_out(self, seq_ids: Sequence[str]) -> dict[int, int]:
        """Move blocks to the host pool; returns {device_block: host_block}."""
        assert self.can_swap_out(seq_ids), "not enough host blocks"
        return self._move(seq_ids, self.device, self.host, swapped=True)

    def swap_in(self, seq_ids: Sequence[str]) -> dict[int, int]:
        """Move blocks back to the device pool; returns {host_block: device_block}."""
        assert self.can_swap_in(seq_ids), "not enough device blocks"
        return self._move(seq_ids, self.host, self.device, swapped=False)

    def _move(self, seq_ids, src: BlockPool, dst: BlockPool, swapped: bool) -> dict[int, int]:
        mapping: dict[int, int] = {}
        for seq_id in seq_ids:
            new_table = []
            for block in self.block_tables[seq_id]:
                if block in mapping:
                    dst.share(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                new_table.append(mapping[block])
                src.free(block)
            self.block_tables[seq_id] = new_table
            (self.swapped_out.add if swapped else self.swapped_out.discard)(seq_id)
        return mapping

    # ------------------------------------------------------------------------------- statistics
    @property
    def usage(self) -> float:
        """Fraction of device blocks held by sequences (cached free blocks count as free)."""
        return 1.0 - self.device.num_free_blocks / self.device.num_blocks

    @property
    def num_blocks_without_sharing(self) -> int:
        """Device blocks the resident sequences would hold if none were shared."""
        return sum(len(t) for seq_id, t in self.block_tables.items() if seq_id not in self.swapped_out)
