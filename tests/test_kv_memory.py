"""KV-memory accounting: contiguous max-length preallocation versus paging, on exact small traces."""

import pytest

from reference import contiguous_usage, paged_usage


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
