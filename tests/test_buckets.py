"""Shape buckets: never smaller than the size, the smallest rung of their ladder, and little padding."""

from hypothesis import given
from hypothesis import strategies as st

from jax_engine.buckets import all_buckets, bucket, bucket_fine, bucket_quarters, bucket_tokens, coarse_cover


def _ladder(fine: bool) -> list[int]:
    powers = [1 << k for k in range(20)]
    return sorted(set(powers + ([p * 3 // 2 for p in powers if p >= 2] if fine else [])))


@given(st.integers(0, 100_000), st.sampled_from([1, 4, 8]))
def test_buckets_are_the_smallest_rung_that_fits(n, minimum):
    for fn, fine in ((bucket, False), (bucket_fine, True)):
        got = fn(n, minimum)
        if n == 0:
            assert got == 0
            continue
        need = max(n, minimum)
        assert got == min(r for r in _ladder(fine) if r >= need), (fn.__name__, n, minimum)
        assert got - need < got * (1 / 3 if fine and need > 2 else 1 / 2) + 1e-9


@given(st.integers(0, 100_000))
def test_quarters_pad_less_than_a_quarter(n):
    got = bucket_quarters(n)
    if n == 0:
        assert got == 0
        return
    step = max((1 << (n.bit_length() - 1)) // 4, 1)  # rungs between the powers of two around n
    assert got >= n and got % step == 0 and got - n < step
    assert got - n < max(n / 4, 1)


@given(st.integers(1, 5000))
def test_token_buckets_are_listed_by_all_buckets(limit):
    listed = all_buckets(bucket_tokens, limit)
    assert listed == sorted(set(listed)) and listed[0] == 1
    # Every size up to the limit falls into a listed bucket, and the list has nothing more.
    assert {bucket_tokens(n) for n in range(1, limit + 1)} == set(listed)
    assert [bucket_tokens(n) for n in (1, 2, 3, 5, 8, 9, 17, 100)] == [1, 2, 4, 8, 8, 16, 20, 112]


@given(st.lists(st.integers(1, 10_000), min_size=1, unique=True).map(sorted), st.integers(2, 16))
def test_a_coarse_cover_pads_each_size_at_most_ratio_times(sizes, ratio):
    kept = coarse_cover(sizes, ratio)
    assert kept == sorted(kept) and set(kept) <= set(sizes) and kept[0] == sizes[0] and kept[-1] == sizes[-1]
    for size in sizes:
        assert min(k for k in kept if k >= size) <= ratio * size
    # Each size kept is needed: without it, the size below it would pad more than `ratio` times.
    for below, above in zip(kept[1:-1], kept[2:]):
        assert above > ratio * below
