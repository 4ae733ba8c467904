"""The greedy-token kernel (jax_engine/sample/cpu_kernel/greedy_argmax.cc) against jax.lax.top_k, which the sampler
used before it: the same token for every bit pattern of logits, ties, NaNs of either sign, infinities, signed zeros."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from jax_engine.sample.greedy_argmax import greedy_tokens, kernel_unavailable_reason

# Bit patterns to draw often: they tie, or sit at the ends of the order. NaNs with the sign bit set sort below -inf.
SPECIAL_BITS = [0x00000000, 0x80000000, 0x3F800000, 0xBF800000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                0x7F800001, 0xFFFFFFFF, 0x00000001, 0x7F7FFFFF, 0xFF7FFFFF]
# Few shapes, so few programs compile: narrow rows (whose maximum is often negative or a NaN), and widths below,
# at and past the kernel's blocks of 64.
SHAPES = [(1, 1), (6, 2), (4, 3), (3, 63), (2, 64), (4, 65), (2, 200)]

kernel_tokens = jax.jit(greedy_tokens)
top_k_tokens = jax.jit(lambda logits: jax.lax.top_k(logits, 1)[1][:, 0].astype(jnp.int32))


def test_the_kernel_is_built_here():
    # Else greedy_tokens falls back to top_k, and the tests below would prove nothing.
    assert kernel_unavailable_reason() is None


@given(st.sampled_from(SHAPES).flatmap(lambda shape: arrays(
    np.uint32, shape, elements=st.one_of(st.sampled_from(SPECIAL_BITS), st.integers(0, 2**32 - 1)))))
def test_the_kernel_picks_top_ks_token(bits):
    logits = bits.view(np.float32)
    np.testing.assert_array_equal(np.asarray(kernel_tokens(logits)), np.asarray(top_k_tokens(logits)))


def test_negative_rows_and_signed_nans_keep_their_order():
    negative_nan = np.array([0xFFC00000], np.uint32).view(np.float32)[0]
    logits = np.array([[-3.0, -1.0, -2.0, -np.inf], [negative_nan, -np.inf, -5.0, -0.0],
                       [-0.0, 0.0, np.nan, np.inf]], np.float32)
    assert np.asarray(kernel_tokens(logits)).tolist() == [1, 3, 2]


def test_the_first_of_equal_maxima_wins_across_blocks():
    logits = np.full((3, 300), -1.0, np.float32)
    logits[0, [70, 10, 299]] = 5.0  # blocks of 64: the first maximum is in the first block
    logits[1, [299, 130]] = 5.0
    logits[2, [64, 63]] = 0.0  # the block edge
    assert np.asarray(kernel_tokens(logits)).tolist() == [10, 130, 63]
