"""The top-k / top-p threshold: the C++ kernel (jax_engine/sample/cpu_kernel/top_k_top_p.cc) and the sort that
runs elsewhere, against the reference sampler's filters in float64, on rows whose logits spread over the kernel's
histogram (ties, masked -inf tokens, logits far below the maximum) and the sizes its walk takes (one bucket or
thousands of tokens)."""

import jax
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from jax_engine.sample.top_k_top_p import kernel_unavailable_reason, sorted_threshold, top_k_top_p_threshold
from reference.request import SamplingParams
from reference.sampler import filtered_probs

kernel = jax.jit(top_k_top_p_threshold)
sort = jax.jit(sorted_threshold)
VOCABS = [1, 7, 300, 5000]  # few shapes: few programs
TOP_P = [1e-6, 0.1, 0.5, 0.9, 0.95, 0.999, 1.0]


def test_the_kernel_is_built_here():
    # Else top_k_top_p_threshold sorts, and the tests below would test the sort twice.
    assert kernel_unavailable_reason() is None


def kept_by_the_reference(row: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The logits the reference sampler keeps, and their equals: it takes equal logits one by one for top-p, where
    a threshold keeps all of them (as vLLM's, whose sort leaves their order unspecified)."""
    kept = filtered_probs(row.astype(np.float64), SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)) > 0
    return np.isin(row, row[kept])


def distance_to_a_tie(row: np.ndarray, top_k: int, top_p: float) -> float:
    """How close (as a fraction of the kept mass) the mass above any kept logit comes to top_p's share of it:
    there the sum's rounding decides, and float32 and float64 sums may part."""
    finite = np.sort(row[np.isfinite(row)])[::-1].astype(np.float64)
    if top_p >= 1.0 or finite.size == 0:
        return np.inf
    kth = finite[min(top_k, finite.size) - 1] if top_k > 0 else -np.inf
    weights = np.exp(finite[finite >= kth] - finite[0])
    above = np.cumsum(weights) - weights
    return float(np.min(np.abs(above - top_p * weights.sum())) / weights.sum())


def kept(row: np.ndarray, threshold: float) -> np.ndarray:
    """What the sampler keeps under a threshold (a -inf logit stays -inf whatever it is)."""
    return (row >= threshold) & (row > -np.inf)


@st.composite
def rows(draw):
    vocab = draw(st.sampled_from(VOCABS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0.01, 1.0, 4.0, 40.0]))  # one bucket (of 1/32) .. past the last (64 below)
    row = (spread * rng.standard_normal(vocab)).astype(np.float32)
    if draw(st.booleans()):  # ties: logits rounded to a coarse grid
        row = np.round(row * 4) / 4
    row[rng.random(vocab) < draw(st.sampled_from([0.0, 0.3]))] = -np.inf  # masked tokens
    if not np.isfinite(row).any():
        row[0] = 0.0
    return row


@given(rows(), st.integers(0, 20) | st.sampled_from([299, 300, 301, 4999, 6000]), st.sampled_from(TOP_P))
def test_each_path_keeps_what_the_reference_keeps(row, top_k, top_p):
    expected = kept_by_the_reference(row, top_k, top_p)
    for threshold, tie in ((kernel, 1e-12), (sort, 1e-5)):  # sums in double, in float32
        got = kept(row, np.asarray(threshold(row[None], np.int32([top_k]), np.float32([top_p])))[0])
        if not np.array_equal(got, expected):  # only where the sums' rounding decides
            assert distance_to_a_tie(row, top_k, top_p) < tie, (got.sum(), expected.sum())


def test_a_nucleus_of_thousands_of_tokens_and_one_bucket_of_them():
    """The walk's bucket is the whole row (every logit within 1/32 of the maximum), then rows of a sampler step."""
    rng = np.random.default_rng(0)
    flat = (0.01 * rng.standard_normal((3, 5000))).astype(np.float32)
    batch = (3 * rng.standard_normal((64, 5000))).astype(np.float32)
    for logits, top_k, top_p in ((flat, [0, 4000, 0], [0.9, 0.9, 0.5]), (batch, [0] * 32 + [50] * 32, [0.95] * 64)):
        thresholds = np.asarray(kernel(logits, np.int32(top_k), np.float32(top_p)))
        for row, k, p, threshold in zip(logits, top_k, top_p, thresholds):
            np.testing.assert_array_equal(kept(row, threshold), kept_by_the_reference(row, k, p))


def test_rows_without_a_finite_logit_keep_what_they_have():
    nan, inf = np.float32(np.nan), np.float32(np.inf)
    logits = np.array([[-inf, -inf, -inf], [0.0, inf, 1.0], [nan, 2.0, 1.0]], np.float32)
    thresholds = np.asarray(kernel(logits, np.int32([0, 0, 1]), np.float32([0.5, 0.5, 1.0])))
    assert thresholds.tolist() == [-inf, inf, 2.0]  # all masked stays masked; +inf alone; NaN never counts


def test_rows_of_the_default_models_vocabulary_in_any_order():
    """SmolLM2's 49152 tokens: top_k's rising bar over rows in random, ascending (every logit raises it) and
    descending order, and top_p's narrowing over a flat row (a nucleus of thousands) and a peaked one."""
    rng = np.random.default_rng(1)
    flat, peaked = 2.5 * rng.standard_normal(49152), 6.0 * rng.standard_normal(49152)
    logits = np.stack([flat, np.sort(flat), np.sort(flat)[::-1], peaked]).astype(np.float32)
    for top_k, top_p in ((40, 1.0), (1000, 0.9), (0, 0.95), (0, 0.5), (50, 0.95)):
        thresholds = np.asarray(kernel(logits, np.int32([top_k] * 4), np.float32([top_p] * 4)))
        for row, threshold in zip(logits, thresholds):
            expected = kept_by_the_reference(row, top_k, top_p)
            if not np.array_equal(kept(row, threshold), expected):
                assert distance_to_a_tie(row, top_k, top_p) < 1e-12
