"""KV-memory accounting: contiguous preallocation versus paging, per request and under load, on exact small traces."""

import pytest

from reference.tutorial.kv_memory import (Chunk, contiguous_usage, contiguous_usage_under_load, first_fit_steps,
                                         paged_usage, paged_usage_under_load)


def test_one_request_exact_slot_counts():
    # prompt 3, output 2: after token 1 → 4 slots used, after token 2 → 5.
    contiguous = contiguous_usage([(3, 2)], max_model_len=8)
    assert (contiguous.used, contiguous.reserved, contiguous.internal_fragmentation) == (9, 1, 6)
    paged = paged_usage([(3, 2)], block_size=4)
    assert (paged.used, paged.reserved, paged.internal_fragmentation) == (9, 0, 0 + 3)
    assert paged.utilization == 9 / 12 and contiguous.utilization == 9 / 16


def test_paging_wastes_less_than_a_block_per_request_per_step():
    trace = [(161, 338), (19, 58), (500, 20)]
    paged = paged_usage(trace, block_size=16)
    steps = sum(output for _, output in trace)
    assert paged.internal_fragmentation < 16 * steps
    assert paged.utilization > 0.95 > 0.4 > contiguous_usage(trace, max_model_len=2048).utilization


def test_bad_traces_are_refused():
    with pytest.raises(ValueError, match="exceeds max_model_len=8"):
        contiguous_usage([(6, 6)], max_model_len=8)
    with pytest.raises(ValueError, match="output_len must be >= 1"):
        paged_usage([(3, 0)], block_size=4)


# --------------------------------------------------------------------------- under load, one arena


def test_first_fit_admits_in_order_and_reuses_the_lowest_hole():
    trace, reservations = [(2, 2), (3, 1), (2, 3)], [4, 4, 5]
    steps = list(first_fit_steps(trace, reservations, arena_slots=10))
    # Step 1: requests 0 and 1 fill slots 0-7; request 2 needs 5 slots and only 8-9 are free: it waits.
    assert steps[0] == ([Chunk(0, 0, 4, 3, 4), Chunk(1, 4, 4, 4, 4)], 1)
    # Request 1 left after its one token; request 2 takes the lowest hole big enough, from slot 4.
    assert steps[1] == ([Chunk(0, 0, 4, 4, 4), Chunk(2, 4, 5, 3, 5)], 0)
    assert [chunks for chunks, _ in steps[2:]] == [[Chunk(2, 4, 5, 4, 5)], [Chunk(2, 4, 5, 5, 5)]]
    usage = contiguous_usage_under_load(trace, reservations, arena_slots=10)
    assert (usage.used, usage.reserved, usage.internal_fragmentation, usage.external_fragmentation) == (7, 1, 0, 2)
    assert usage.total == 10  # one step counted: the only one with a request waiting


def test_holes_too_small_for_the_next_request_are_external_fragmentation():
    # Chunks of 2, 4 and 2 slots fill an 8-slot arena; the first and last leave after one token. Four slots
    # are then free, more than the 3 that request 3 needs, but in two holes of 2: it waits for request 1.
    trace, reservations = [(1, 1), (1, 3), (1, 1), (2, 1)], [2, 4, 2, 3]
    steps = list(first_fit_steps(trace, reservations, arena_slots=8))
    assert [waiting for _, waiting in steps] == [1, 1, 1, 0]
    assert [c.start for c in steps[1][0]] == [2] and [c.start for c in steps[3][0]] == [0]
    usage = contiguous_usage_under_load(trace, reservations, arena_slots=8)
    assert usage.external_fragmentation == 0 + 4 + 4


def test_paged_usage_under_load_counts_the_reference_schedulers_blocks():
    # Blocks of 2, 3 blocks. Step 1: request 0 (3 prompt tokens) takes 2 blocks; request 1 needs 2 and waits.
    # Step 2: request 0 decodes its 4th token into its second block and finishes; request 1 still waits.
    usage = paged_usage_under_load([(3, 2), (4, 1)], block_size=2, num_blocks=3, max_model_len=8)
    assert (usage.used, usage.reserved, usage.internal_fragmentation, usage.external_fragmentation) == (7, 0, 1, 4)


def test_under_load_paging_keeps_waste_below_contiguous_reservations():
    trace = [(161, 338), (19, 58), (500, 20), (40, 700), (300, 300), (10, 10)] * 5
    paged = paged_usage_under_load(trace, block_size=16, num_blocks=200, max_model_len=2048)
    exact = contiguous_usage_under_load(trace, [p + o for p, o in trace], arena_slots=3200)
    assert paged.utilization > 0.9 > exact.utilization
    assert paged.reserved == 0 and exact.internal_fragmentation == 0


def test_reservations_must_hold_their_request_and_fit_the_arena():
    with pytest.raises(ValueError, match="reservation must hold its request"):
        list(first_fit_steps([(3, 2)], [4], arena_slots=8))
    with pytest.raises(ValueError, match="reservation must hold its request"):
        list(first_fit_steps([(3, 2)], [9], arena_slots=8))
