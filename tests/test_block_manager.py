"""Exact-value tests of the block pool and block manager: block ids, ref counts, eviction order."""

import pytest

from jax_engine.core.block_pool import BlockPool as EngineBlockPool
from reference import BlockManager, BlockPool, hash_block_tokens


def test_pool_hands_out_blocks_in_order_and_frees_to_the_tail():
    pool = BlockPool(4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert [a.block_id, b.block_id, c.block_id] == [0, 1, 2]
    pool.free(b)
    pool.free(a)
    assert list(pool.free_queue) == [3, 1, 0]
    assert pool.allocate().block_id == 3
    assert pool.allocate().block_id == 1


@pytest.mark.parametrize("pool_class", [BlockPool, EngineBlockPool], ids=["reference", "engine"])
def test_misuse_of_a_pool_is_caught(pool_class):
    """Both layers' pools keep the same state asserts: a bookkeeping bug stops at once, not blocks later."""
    pool = pool_class(1)
    block = pool.allocate()
    with pytest.raises(AssertionError, match="no free block"):
        pool.allocate()
    pool.free(block)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(block)
    with pytest.raises(AssertionError, match="caching unheld block"):
        pool.cache(block, hash_block_tokens(None, (1, 2)))


def test_chained_hash_depends_on_the_whole_prefix():
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(hash_block_tokens(None, [9, 9]), [3, 4])
    assert hash_block_tokens(first, [3, 4]) == hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])


def test_allocate_gives_a_block_table_covering_all_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", list(range(10))) == 0  # nothing cached yet
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.device.num_free_blocks == 5
    assert [b.ref_cnt for b in bm.block_tables["a"]] == [1, 1, 1]


def test_append_slots_grows_only_at_block_boundaries():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", [1, 2, 3, 4])
    assert bm.append_slots("a", num_computed_tokens=4, num_new_tokens=1) == []
    assert bm.block_table("a") == [0, 1]
    bm.append_slots("a", num_computed_tokens=5, num_new_tokens=3)
    assert bm.block_table("a") == [0, 1]


def test_fork_shares_blocks_and_copy_on_write_splits_the_last_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("parent", [1, 2, 3, 4, 5, 6])  # blocks 0 (full) and 1 (2 of 4 slots)
    bm.fork("parent", "child")
    assert [b.ref_cnt for b in bm.block_tables["parent"]] == [2, 2]
    # The child writes position 6, inside shared block 1: it gets a private copy, block 2.
    assert bm.append_slots("child", num_computed_tokens=6, num_new_tokens=1) == [(1, 2)]
    assert bm.block_table("child") == [0, 2]
    assert bm.block_table("parent") == [0, 1]
    # Block 1 now belongs to the parent alone: no copy when it writes.
    assert bm.append_slots("parent", num_computed_tokens=6, num_new_tokens=1) == []
    assert [b.ref_cnt for b in bm.device.blocks[:3]] == [2, 1, 1]


def test_prefix_cache_hit_reuses_blocks_and_keeps_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    bm.allocate("a", prompt)
    bm.cache_full_blocks("a", prompt, num_computed_tokens=10)
    assert bm.allocate("b", prompt + [7]) == 8  # both full blocks hit
    assert bm.block_table("b")[:2] == [0, 1] and bm.device.blocks[0].ref_cnt == 2
    # An identical 8-token prompt hits only one block: the last token must be computed.
    assert bm.allocate("c", prompt[:8]) == 4
    assert bm.prefix_cache_hits == 12 and bm.prefix_cache_queries == 10 + 11 + 8


def test_a_request_that_skips_reading_the_cache_computes_all_and_still_fills_it():
    """prompt_logprobs needs every prompt position computed: no hits, but its blocks serve later requests."""
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(100, 110))
    bm.allocate("a", prompt)
    bm.cache_full_blocks("a", prompt, num_computed_tokens=10)
    assert bm.find_cached_prefix(prompt + [7], read_cache=False) == []
    assert bm.allocate("scored", prompt + [7], read_cache=False) == 0
    assert bm.block_table("scored")[:2] != bm.block_table("a")[:2]  # fresh blocks, not the cached ones
    bm.free("a")
    bm.cache_full_blocks("scored", prompt + [7], num_computed_tokens=11)
    assert bm.allocate("b", prompt + [8]) == 8  # "a"'s blocks, still indexed, or "scored"'s: a hit either way


def test_freed_cached_blocks_stay_reusable_until_evicted_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]  # blocks 0, 1, 2 full; block 3 partial
    bm.allocate("a", prompt)
    bm.cache_full_blocks("a", prompt, num_computed_tokens=7)
    bm.free("a")
    assert list(bm.device.free_queue) == [3, 2, 1, 0]  # the tail is evicted first
    assert bm.allocate("b", [9, 9]) == 0 and bm.block_table("b") == [3]
    assert bm.allocate("c", [8, 8]) == 0 and bm.block_table("c") == [2]  # evicts [5, 6]
    assert bm.device.lookup(hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])) is not None
    bm.free("b")
    bm.free("c")
    assert list(bm.device.free_queue) == [1, 0, 3, 2]
    assert bm.allocate("d", [1, 2, 3, 4, 5, 6, 0]) == 4  # [1,2],[3,4] still cached; [5,6] was evicted
    assert bm.block_table("d") == [0, 1, 3, 2]


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    bm.allocate("a", [1, 2, 3])
    bm.cache_full_blocks("a", [1, 2, 3], 3)
    assert bm.allocate("b", [1, 2, 3]) == 0 and bm.device.cached_blocks == {}


def test_swap_out_and_in_moves_blocks_between_pools():
    bm = BlockManager(num_blocks=4, block_size=2, num_host_blocks=3)
    bm.allocate("a", [1, 2, 3])
    bm.fork("a", "b")  # shared blocks move once
    assert bm.swap_out(["a", "b"]) == {0: 0, 1: 1}
    assert bm.device.num_free_blocks == 4 and bm.host.num_free_blocks == 1
    assert bm.block_table("a") == bm.block_table("b") == [0, 1]
    assert [b.ref_cnt for b in bm.host.blocks] == [2, 2, 0]
    bm.allocate("c", [5])  # takes device block 2... from the free queue's head
    assert bm.swap_in(["a", "b"]) == {0: bm.block_table("a")[0], 1: bm.block_table("a")[1]}
    assert "a" not in bm.swapped_out and bm.host.num_free_blocks == 3
    for seq in ("a", "b", "c"):
        bm.free(seq)
    assert bm.device.num_free_blocks == 4 and all(b.ref_cnt == 0 for b in bm.device.blocks)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)
