"""The engine's jitted sampler against the reference sampler's filters, and its seeded randomness."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_engine.outputs import RequestMetrics
from jax_engine.sample.sampler import sample
from jax_engine.sample.sampling_batch import sampling_batch
from jax_engine.sampling_params import SamplingParams
from jax_engine.sequence import Sequence
from reference.sampler import filtered_probs, processed_logits

VOCAB = 32


def make_sequence(params: SamplingParams, seed: int = 0, prompt=(1, 2, 3), output=()) -> Sequence:
    seq = Sequence("r", "r", 0, list(prompt), params, 0, seed, params.max_tokens or 16, (0,), None,
                   RequestMetrics(0.0))
    seq.all_token_ids += list(output)
    return seq


def run(seqs: list[Sequence], logits: np.ndarray, num_rows: int | None = None):
    num_rows = num_rows or len(seqs)
    padded = np.zeros((num_rows, logits.shape[1]), np.float32)
    padded[: len(logits)] = logits
    result, _ = sample(padded, sampling_batch(seqs, num_rows, logits.shape[1]))
    return [np.asarray(x)[: len(seqs)] for x in (result.tokens, result.logprobs, result.ranks,
                                                        result.top_ids, result.top_logprobs)]


@given(seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.5, 1.0, 1.5]),
       top_k=st.sampled_from([0, 1, 3, 10]), top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]),
       min_p=st.sampled_from([0.0, 0.05, 0.3]))
def test_sampled_tokens_are_always_ones_the_reference_keeps(seed, temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (8, VOCAB)).astype(np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    seqs = [make_sequence(params, seed=seed + i) for i in range(8)]
    tokens = run(seqs, logits)[0]
    for row, token in zip(logits, tokens):
        assert filtered_probs(row, params)[token] > 0


def test_sampled_frequencies_follow_the_reference_distribution():
    logits = np.log(np.array([[0.4, 0.3, 0.15, 0.1, 0.05] + [1e-9] * 3], np.float32))
    params = SamplingParams(temperature=0.8, top_p=0.9)
    seqs = [make_sequence(params, seed=s) for s in range(2000)]
    tokens = run(seqs, np.repeat(logits, 2000, axis=0))[0]
    expected = filtered_probs(logits[0], params)
    counts = np.bincount(tokens, minlength=8) / 2000
    np.testing.assert_allclose(counts, expected, atol=0.035)  # ~3.5 standard errors at n = 2000


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1, (16, VOCAB)).astype(np.float32)
    params = SamplingParams(temperature=1.0, seed=42)
    alone = [run([make_sequence(params, seed=42)], logits[i : i + 1])[0][0] for i in range(16)]
    batched = run([make_sequence(params, seed=42) for _ in range(16)], logits, num_rows=32)[0]
    assert list(batched) == alone
    assert len(set(alone)) > 1


def test_the_position_being_sampled_changes_the_draw():
    """Same seed, same logits: the uniform comes from (seed, position), so later positions draw anew."""
    flat = np.zeros((1, VOCAB), np.float32)
    params = SamplingParams(temperature=1.0, seed=42)
    draws = [run([make_sequence(params, seed=42, output=[5] * k)], flat)[0][0] for k in range(16)]
    again = [run([make_sequence(params, seed=42, output=[5] * k)], flat)[0][0] for k in range(16)]
    assert draws == again  # seeded: the same position draws the same token
    assert len(set(draws)) > 4  # 16 draws over 32 equally likely tokens: one repeated value would be a bug


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    """A batch mixing greedy and sampled rows (the argmax is only computed when some row is greedy)."""
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1, (16, VOCAB)).astype(np.float32)
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0)
    seqs = [make_sequence(greedy if i % 2 else sampled, seed=i) for i in range(16)]
    tokens = run(seqs, logits)[0]
    assert list(tokens[1::2]) == list(logits[1::2].argmax(axis=1))
    assert list(tokens[::2]) != list(logits[::2].argmax(axis=1))  # the sampled rows did sample


def test_greedy_logprobs_and_ranks():
    logits = np.array([[1.0, 3.0, 2.0, 0.0]], np.float32)
    tokens, logprobs, ranks, top_ids, top_logprobs = run([make_sequence(SamplingParams(temperature=0, logprobs=2))], logits)
    expected = logits[0] - np.log(np.exp(logits[0]).sum())  # float64; the sampler's log-softmax is float32
    assert tokens[0] == 1 and ranks[0] == 1 and logprobs[0] == pytest.approx(expected[1], abs=1e-6)
    assert list(top_ids[0][:2]) == [1, 2] and top_logprobs[0][:2] == pytest.approx(expected[[1, 2]], abs=1e-6)


def test_penalties_follow_vllm():
    logits = np.array([[3.0, 2.9, -1.0, 0.5]], np.float32)
    # Token 0 was generated twice: a frequency penalty of 0.1 per occurrence lets token 1 win.
    freq = make_sequence(SamplingParams(temperature=0, frequency_penalty=0.1), output=[0, 0])
    assert run([freq], logits)[0][0] == 1
    # Repetition penalty 1.2 divides the positive logit of a seen token (3.0 -> 2.5 < 2.9).
    rep = make_sequence(SamplingParams(temperature=0, repetition_penalty=1.2), prompt=[0])
    assert run([rep], logits)[0][0] == 1
    # Presence penalty subtracts once, however often the token appeared.
    pres = make_sequence(SamplingParams(temperature=0, presence_penalty=0.05), output=[0, 0, 0])
    assert run([pres], logits)[0][0] == 0


def test_min_tokens_bans_stop_and_eos_tokens():
    logits = np.array([[5.0, 4.0, 1.0, 0.0]], np.float32)  # token 0 is EOS here
    early = make_sequence(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1]))
    assert run([early], logits)[0][0] == 2
    done = make_sequence(SamplingParams(temperature=0, min_tokens=2), output=[3, 3])
    assert run([done], logits)[0][0] == 0


@given(seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.0, 0.7, 1.0]),
       allowed=st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)),
       bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4),
       bad=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3), max_size=3),
       output=st.lists(st.integers(0, VOCAB - 1), max_size=4))
def test_token_controls_follow_the_reference(seed, temperature, allowed, bias, bad, output):
    """allowed_token_ids, bad words and logit_bias, mixed in one batch with a row that has none: a greedy
    row takes the reference's argmax, a sampled one a token the reference can draw."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (2, VOCAB)).astype(np.float32)
    params = SamplingParams(temperature=temperature, seed=seed, allowed_token_ids=allowed, logit_bias=bias or None,
                            bad_words_token_ids=bad)
    expected = processed_logits(logits[0], params, output)
    if np.isneginf(expected).all():
        return  # every allowed token is a bad word here: nothing can be sampled
    plain = SamplingParams(temperature=temperature, seed=seed)
    tokens = run([make_sequence(params, seed=seed, output=output), make_sequence(plain, seed=seed)], logits)[0]
    if temperature == 0:
        assert tokens[0] == np.argmax(expected)
        assert tokens[1] == np.argmax(logits[1])
    else:
        assert filtered_probs(expected, params)[tokens[0]] > 0


def test_logit_bias_and_allowed_tokens_move_the_distribution():
    flat = np.zeros((2000, VOCAB), np.float32)
    biased = SamplingParams(temperature=1.0, logit_bias={3: 2.0})
    tokens = run([make_sequence(biased, seed=s) for s in range(2000)], flat)[0]
    expected = np.exp(2.0) / (np.exp(2.0) + VOCAB - 1)  # ~0.19 for token 3, 1/39 for each other
    assert abs(np.mean(tokens == 3) - expected) < 0.035
    allowed = SamplingParams(temperature=1.0, allowed_token_ids=[4, 9])
    tokens = run([make_sequence(allowed, seed=s) for s in range(200)], flat[:200])[0]
    assert set(tokens) == {4, 9}


@given(seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.0, 0.7, 1.0]),
       allowed=st.lists(st.integers(0, 69), min_size=1, max_size=12, unique=True))
def test_a_grammar_bitmask_keeps_what_the_reference_allows(seed, temperature, allowed):
    """A row's grammar bitmask (bit t % 32 of word t // 32) acts as allowed_token_ids does in the reference, over
    a vocabulary of 70 that ends inside its third word; the row beside it, with no grammar, is untouched."""
    vocab = 70
    logits = np.random.default_rng(seed).normal(0, 2, (2, vocab)).astype(np.float32)
    bitmask = np.zeros((2, 3), np.uint32)
    for t in allowed:
        bitmask[0, t // 32] |= np.uint32(1 << (t % 32))
    bitmask[1] = 0xFFFFFFFF
    params = SamplingParams(temperature=temperature, seed=seed)
    seqs = [make_sequence(params, seed=seed), make_sequence(params, seed=seed)]
    result, _ = sample(logits, sampling_batch(seqs, 2, vocab, bitmask.view(np.int32)))
    plain, _ = sample(logits, sampling_batch(seqs, 2, vocab))
    reference_params = SamplingParams(temperature=temperature, seed=seed, allowed_token_ids=allowed)
    expected = processed_logits(logits[0], reference_params)
    token = int(result.tokens[0])
    if temperature == 0:
        assert token == np.argmax(expected)
    else:
        assert filtered_probs(expected, params)[token] > 0
    assert int(result.tokens[1]) == int(plain.tokens[1])


def test_controls_that_leave_a_grammar_row_nothing_give_way_to_the_grammar():
    """A grammar that allows only EOS (token 0 here) beside min_tokens, which bans EOS: the grammar wins, in a
    greedy and a sampled row; a row whose controls leave something keeps them."""
    logits = np.random.default_rng(0).normal(0, 1, (3, VOCAB)).astype(np.float32)
    only_eos = np.array([[1], [1], [0b1110]], np.int32)  # rows 0, 1: token 0; row 2: tokens 1-3
    seqs = [make_sequence(SamplingParams(temperature=t, min_tokens=5, seed=1)) for t in (0.0, 1.0)]
    seqs.append(make_sequence(SamplingParams(temperature=0, allowed_token_ids=[2, 9])))
    result, _ = sample(logits, sampling_batch(seqs, 3, VOCAB, only_eos))
    assert [int(t) for t in result.tokens] == [0, 0, 2]


def test_a_row_without_weight_never_draws_a_padding_index():
    """The inverse-CDF draw pads the vocabulary to blocks of 256; a row whose weights are all zero (or NaN) once
    drew index 511 of a 258-token vocabulary in the full suite (test_request_limits). It says -1, and the
    sampler gives such a row its argmax."""
    import jax.numpy as jnp

    from jax_engine.sample.sampler import _draw

    weights = jnp.zeros((3, 258)).at[1].set(jnp.nan).at[2, 257].set(1.0)
    tokens = _draw(weights, jnp.asarray([1, 2, 3]), jnp.asarray([0, 0, 0]))
    assert tokens.tolist() == [-1, -1, 257]
