"""Shape buckets: round sizes up to powers of two so only a few shapes ever compile."""


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum); 0 stays 0 (an empty part of the batch)."""
    return 0 if n == 0 else 1 << (max(n, minimum) - 1).bit_length()
