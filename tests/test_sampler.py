"""Reference sampler: each filter keeps exactly the tokens it should; seeded draws depend on (seed, position)."""

import numpy as np
import pytest

from reference import SamplingParams, sample
from reference.sampler import filtered_probs, processed_logits

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))


@pytest.mark.parametrize("params, kept", [
    (SamplingParams(top_k=2), [0, 1]),
    (SamplingParams(top_p=0.7), [0, 1]),  # 0.5 + 0.2 reaches 0.7
    (SamplingParams(top_p=0.71), [0, 1, 2]),
    (SamplingParams(top_p=0.1), [0]),  # always at least the most likely token
    (SamplingParams(min_p=0.3), [0, 1, 2]),  # p >= 0.3 * 0.5
    (SamplingParams(top_k=-1), [0, 1, 2, 3, 4]),
])
def test_filters_keep_the_right_tokens(params, kept):
    probs = filtered_probs(LOGITS, params)
    assert list(np.flatnonzero(probs)) == kept
    assert np.isclose(probs.sum(), 1.0)
    np.testing.assert_allclose(probs[kept], np.exp(LOGITS[kept]) / np.exp(LOGITS[kept]).sum())


def test_temperature_sharpens_and_flattens():
    cold, hot = filtered_probs(LOGITS, SamplingParams(temperature=0.5)), filtered_probs(LOGITS, SamplingParams(temperature=2.0))
    assert cold[0] > 0.5 > hot[0]


def test_greedy_takes_the_argmax_with_ties_to_the_lowest_id():
    assert sample(np.array([1.0, 3.0, 3.0]), SamplingParams(temperature=0), 0, np.random.default_rng()) == 1


def test_seeded_draws_depend_only_on_seed_and_position():
    params = SamplingParams(seed=5)
    draws = [sample(LOGITS, params, position, np.random.default_rng(i)) for i, position in enumerate(range(40))]
    again = [sample(LOGITS, params, position, np.random.default_rng(99)) for position in range(40)]
    assert draws == again and len(set(draws)) > 1


def test_unseeded_draws_follow_the_distribution():
    rng = np.random.default_rng(0)
    counts = np.bincount([sample(LOGITS, SamplingParams(), 0, rng) for _ in range(4000)], minlength=5) / 4000
    np.testing.assert_allclose(counts, np.exp(LOGITS), atol=0.03)  # ~4 standard errors at n = 4000


def test_token_controls_change_the_logits_in_vllms_order():
    logits = np.zeros(6)
    params = SamplingParams(allowed_token_ids=[1, 2, 3], bad_words_token_ids=[[2], [4, 3], [5, 1]],
                            logit_bias={1: 5.0, 0: 9.0})
    # 2 is always banned (a one-token word); 3 only after a 4; 1 only after a 5. 0 is not allowed, whatever its bias.
    assert list(processed_logits(logits, params, [0])) == [-np.inf, 5.0, -np.inf, 0.0, -np.inf, -np.inf]
    assert list(processed_logits(logits, params, [0, 4])) == [-np.inf, 5.0, -np.inf, -np.inf, -np.inf, -np.inf]
    assert processed_logits(logits, params, [5])[1] == -np.inf
    assert processed_logits(logits, params, [])[1] == 5.0  # a word longer than the output never matches


def test_token_controls_are_range_checked():
    # The oracle's plain range check; the engine's limits (bias range, list sizes) are in tests/test_input_checks.py.
    with pytest.raises(ValueError, match="allowed_token_ids must be non-empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words_token_ids must be non-empty token-id sequences"):
        SamplingParams(bad_words_token_ids=[[]])
