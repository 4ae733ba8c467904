"""Shape buckets: round sizes up to a few rungs (powers of two and between) so only a few shapes ever compile."""

from reference.block_manager import cdiv


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum); 0 stays 0 (an empty part of the batch)."""
    return 0 if n == 0 else 1 << (max(n, minimum) - 1).bit_length()


def bucket_fine(n: int, minimum: int = 1) -> int:
    """The smallest power of two or 1.5 x power of two >= max(n, minimum): at most a third is padding.

    For sizes whose cost grows with the padding (the context every decode sequence attends over), at the
    price of about twice as many distinct shapes as `bucket`.
    """
    if n == 0:
        return 0
    power = bucket(n, minimum)
    three_quarters = power // 4 * 3  # = 1.5 x the power of two below
    return three_quarters if three_quarters >= max(n, minimum) and power >= 4 else power


def bucket_quarters(n: int) -> int:
    """The smallest multiple of a quarter of the largest power of two <= n that is >= n: less than a quarter
    of n is padding, with four rungs per doubling.

    For the step's token count, where every padding token costs a full token's compute in every layer.
    Eighths would pad half as much but double the programs that start-up loads (~0.2 s each).
    """
    if n == 0:
        return 0
    step = max((1 << (n.bit_length() - 1)) // 4, 1)
    return cdiv(n, step) * step


def bucket_tokens(n: int) -> int:
    """The step's token count: powers of two up to 16, then `bucket_quarters`.

    Below 16 rows a step is bound by reading the weights (jax_engine/linear), so 1, 2 and 4 tokens run
    faster than 8 padded ones, and padding within a power of two costs almost nothing.
    """
    return bucket(n) if n <= 16 else bucket_quarters(n)


def all_buckets(bucket_fn, limit: int) -> list[int]:
    """Every distinct bucket_fn(n) for 1 <= n <= limit, ascending: the shapes a start-up compiles."""
    sizes, n = [], 1
    while n <= limit:
        sizes.append(bucket_fn(n))
        n = sizes[-1] + 1
    return sizes


def coarse_cover(sizes: list[int], ratio: int) -> list[int]:
    """As few of `sizes` (ascending) as cover them all with at most `ratio` times the work: each size left out
    pads up to a kept one at most `ratio` times larger. The smallest is kept too (a lone request's decode).

    >>> coarse_cover([1, 2, 4, 8, 16, 20, 24, 32, 64, 80], 4)
    [1, 2, 16, 80]
    """
    kept = [sizes[-1]]
    for size in reversed(sizes[:-1]):  # from the top, keeping a size only where the next kept one is too far
        if kept[-1] > ratio * size or size == sizes[0]:
            kept.append(size)
    return kept[::-1]
