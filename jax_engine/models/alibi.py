"""ALiBi slopes (Press et al., 2022): each head adds slope x (key position - query position) to its scores.

No position embedding at all: the farther back a key, the lower its score, steeply for some heads and gently
for others. The slopes are a geometric sequence; BLOOM and MPT differ only when the number of heads is not
a power of two. The attention backends add the bias (jax_engine/attention, reference/paged_attention.py).
"""

import math

import numpy as np


def bloom_slopes(num_heads: int) -> tuple[float, ...]:
    """BLOOM's (and Falcon-RW's): 2^(-8 i / n) for the largest power of two n <= heads, then every other
    slope of the next power of two for the remaining heads (transformers' build_alibi_tensor)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = _geometric(closest)
    if closest != num_heads:
        slopes = np.concatenate([slopes, _geometric(2 * closest)[0::2][:num_heads - closest]])
    return tuple(float(s) for s in slopes)


def mpt_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> tuple[float, ...]:
    """MPT's: 2^(-max i / n) for the next power of two n >= heads, odd positions first when there are more
    slopes than heads (transformers' build_mpt_alibi_tensor)."""
    padded = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / 2.0 ** (np.arange(1, padded + 1) * (alibi_bias_max / padded))
    if padded != num_heads:
        slopes = np.concatenate([slopes[1::2], slopes[::2]])[:num_heads]
    return tuple(float(s) for s in slopes)


def _geometric(n: int) -> np.ndarray:
    return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)
