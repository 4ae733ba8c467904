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


def bucket_eighths(n: int, minimum: int = 8) -> int:
    """The smallest multiple of an eighth of the largest power of two <= n (and of `minimum`) that is >= n:
    less than an eighth of n is padding, with eight rungs per doubling.

    For the step's token count, where every padding token costs a full token's compute in every layer;
    worth the extra shapes (each compiles once) on long runs.
    """
    if n == 0:
        return 0
    step = max((1 << (n.bit_length() - 1)) // 8, minimum)
    return cdiv(n, step) * step
