"""The oracle's speculative decoding (issue 44): vLLM's n-gram proposer, and a rejection sampler that is exact.

Exactness is checked three ways on a tiny "model" (a fixed random distribution for every prefix): an exact
enumeration of every draft and acceptance outcome, a sampled chi-square test of `rejection_sample` itself, and
greedy speculative decoding against plain greedy decoding, token for token.
"""

import math
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats  # installed with jax, which depends on it

from reference import speculative
from reference.request import SamplingParams
from reference.sampler import filtered_probs, processed_logits, sample
from reference.speculative import (
    acceptance_probability,
    propose_ngram,
    rejection_sample,
    residual_distribution,
    target_probs_from_logits,
)

Prefix = tuple[int, ...]
GREEDY = SamplingParams(temperature=0)


class TinyModel:
    """p(. | prefix): a random distribution fixed by (seed, prefix), with about `zero_fraction` of its tokens at
    probability zero (never all), or one-hot at a random token when `one_hot` (an n-gram-like proposer)."""

    def __init__(self, seed: int, vocab_size: int, zero_fraction: float = 0.0, one_hot: bool = False) -> None:
        self.seed, self.vocab_size, self.zero_fraction, self.one_hot = seed, vocab_size, zero_fraction, one_hot
        self.cache: dict[Prefix, np.ndarray] = {}

    def __call__(self, prefix: Prefix) -> np.ndarray:
        if prefix not in self.cache:
            rng = np.random.default_rng([self.seed, len(prefix), *prefix])  # the length keeps prefixes apart
            probs = rng.dirichlet(np.ones(self.vocab_size))
            zero = rng.random(self.vocab_size) < self.zero_fraction
            zero[rng.integers(self.vocab_size)] = False
            probs = np.where(zero, 0.0, probs)
            if self.one_hot:
                probs = np.eye(self.vocab_size)[np.argmax(probs)]
            self.cache[prefix] = probs / probs.sum()
        return self.cache[prefix]

    def logits(self, prefix: Prefix) -> np.ndarray:
        return np.log(self(prefix) + 1e-3)  # finite, and the same argmax


# ------------------------------------------------------------------------------------- exact distributions
def step_distribution(target: TinyModel, draft: TinyModel, prefix: Prefix, k: int) -> dict[Prefix, float]:
    """The exact distribution of what one speculative step emits: every draft path and acceptance outcome."""
    emitted: dict[Prefix, float] = defaultdict(float)

    def walk(accepted: Prefix, weight: float) -> None:
        p = target(prefix + accepted)
        if len(accepted) == k:  # every draft accepted: the bonus token
            for y in np.flatnonzero(p):
                emitted[accepted + (int(y),)] += weight * p[y]
            return
        q = draft(prefix + accepted)  # the draft drew its earlier tokens, which were all accepted
        for x in np.flatnonzero(q):
            accept = acceptance_probability(p[x], q[x])
            if accept > 0:
                walk(accepted + (int(x),), weight * q[x] * accept)
            residual = residual_distribution(p, q)
            for y in np.flatnonzero(residual) if accept < 1 else []:
                emitted[accepted + (int(y),)] += weight * q[x] * (1 - accept) * residual[y]

    walk((), 1.0)
    return emitted


def speculative_distribution(target: TinyModel, draft: TinyModel, prefix: Prefix, k: int,
                             m: int) -> dict[Prefix, float]:
    """The exact distribution of the first m tokens emitted by speculative steps from `prefix`."""
    if m == 0:
        return {(): 1.0}
    out: dict[Prefix, float] = defaultdict(float)
    for emitted, weight in step_distribution(target, draft, prefix, k).items():
        head = emitted[:m]
        for rest, rest_weight in speculative_distribution(target, draft, prefix + head, k, m - len(head)).items():
            out[head + rest] += weight * rest_weight
    return out


def autoregressive_distribution(target: TinyModel, prefix: Prefix, m: int) -> dict[Prefix, float]:
    """prod_t p(x_t | x_<t) over every sequence of m tokens."""
    if m == 0:
        return {(): 1.0}
    p = target(prefix)
    return {(int(x),) + rest: p[x] * weight for x in np.flatnonzero(p)
            for rest, weight in autoregressive_distribution(target, prefix + (int(x),), m - 1).items()}


def assert_same_distribution(a: dict[Prefix, float], b: dict[Prefix, float], tol: float = 1e-12) -> None:
    worst = max(abs(a.get(key, 0.0) - b.get(key, 0.0)) for key in a.keys() | b.keys())
    print(f"max |difference| over {len(a.keys() | b.keys())} sequences: {worst:.2e}")
    assert worst <= tol


@st.composite
def target_and_draft(draw) -> tuple[TinyModel, TinyModel, int]:
    """A target, a draft (another model, the target itself, or one-hot) and k; zeros in either."""
    vocab_size, k = draw(st.integers(3, 5)), draw(st.integers(1, 3))
    target = TinyModel(draw(st.integers(0, 2**32)), vocab_size, draw(st.sampled_from([0.0, 0.3, 0.6])))
    kind = draw(st.sampled_from(["model", "same", "one-hot"]))
    draft_seed, draft_zeros = draw(st.integers(0, 2**32)), draw(st.sampled_from([0.0, 0.3, 0.6]))
    draft = target if kind == "same" else TinyModel(draft_seed, vocab_size, draft_zeros, one_hot=kind == "one-hot")
    return target, draft, k


@given(target_and_draft(), st.lists(st.integers(0, 2), max_size=2))
def test_speculative_sampling_emits_exactly_the_target_distribution(models, prompt):
    target, draft, k = models
    m = k + 1  # the longest one step emits; shorter steps are followed by more steps
    assert_same_distribution(speculative_distribution(target, draft, tuple(prompt), k, m),
                             autoregressive_distribution(target, tuple(prompt), m))


def test_exactness_check_tells_an_uncorrected_draft_from_the_target():
    target, draft = TinyModel(1, 4), TinyModel(2, 4)
    draft_only = speculative_distribution(draft, draft, (), 2, 2)  # what accepting every draft would emit
    with pytest.raises(AssertionError):
        assert_same_distribution(draft_only, autoregressive_distribution(target, (), 2))


# ------------------------------------------------------------------------------------- sampled check
def speculative_generate(target: TinyModel, draft: TinyModel, k: int, m: int, rng: np.random.Generator) -> Prefix:
    """The first m tokens of speculative decoding from an empty prompt: draft k, verify, repeat."""
    out: list[int] = []
    while len(out) < m:
        context, drafts, draft_rows = tuple(out), [], []
        for _ in range(k):
            q = draft(context + tuple(drafts))
            draft_rows.append(q)
            drafts.append(int(rng.choice(len(q), p=q)))
        target_rows = np.stack([target(context + tuple(drafts[:i])) for i in range(k + 1)])
        out += rejection_sample(drafts, np.stack(draft_rows), target_rows, rng)
    return tuple(out[:m])


CHI_SQUARE_ALPHA = 1e-3  # the false-alarm rate of each statistic below, for a seed picked at random


def chi_square_margins(target: TinyModel, draft: TinyModel, samples: int, seed: int) -> list[float]:
    """For the first token and the first two tokens of `samples` speculative generations: the chi-square
    statistic against the exact target distribution, as a fraction of its 1 - alpha quantile (< 1 passes)."""
    rng, counts = np.random.default_rng(seed), defaultdict(int)
    for _ in range(samples):
        counts[speculative_generate(target, draft, 2, 2, rng)] += 1
    margins = []
    for m in (1, 2):
        observed: dict[Prefix, int] = defaultdict(int)
        for tokens, count in counts.items():
            observed[tokens[:m]] += count
        expected = autoregressive_distribution(target, (), m)
        assert set(observed) <= set(expected), "emitted a sequence the target gives probability zero"
        cells = sorted(expected)
        statistic, _ = stats.chisquare([observed[c] for c in cells], [samples * expected[c] for c in cells])
        threshold = stats.chi2.ppf(1 - CHI_SQUARE_ALPHA, df=len(cells) - 1)
        print(f"first {m} token(s): chi2 = {statistic:.1f}, {len(cells) - 1} dof, threshold {threshold:.1f}")
        margins.append(statistic / threshold)
    return margins


def test_sampled_first_two_tokens_pass_a_chi_square_test():
    """The seed is fixed, so the test is deterministic; a correct sampler fails each statistic for a fraction
    CHI_SQUARE_ALPHA of seeds. Cells the target gives probability zero must stay empty."""
    margins = chi_square_margins(TinyModel(7, 4, zero_fraction=0.3), TinyModel(8, 4), 20_000, seed=2023)
    assert max(margins) < 1


def test_the_chi_square_test_catches_resampling_from_the_target_after_a_rejection(monkeypatch):
    # A plausible bug: on rejection, draw from p instead of norm(max(0, p - q)); that favours the draft's tokens.
    monkeypatch.setattr(speculative, "residual_distribution", lambda target_probs, draft_probs: target_probs)
    margins = chi_square_margins(TinyModel(7, 4, zero_fraction=0.3), TinyModel(8, 4), 20_000, seed=2023)
    assert min(margins) > 1


def test_a_draft_proposer_without_probabilities_is_a_one_hot_draft():
    target = TinyModel(3, 5, zero_fraction=0.4)
    drafts = [0, 3, 1]
    rows = np.stack([target(tuple(drafts[:i])) for i in range(4)])
    one_hot = np.eye(5)[drafts]
    for seed in range(50):
        assert (rejection_sample(drafts, None, rows, np.random.default_rng(seed))
                == rejection_sample(drafts, one_hot, rows, np.random.default_rng(seed)))


# ------------------------------------------------------------------------------------- greedy
LogitsFn = Callable[[Prefix], np.ndarray]


def greedy_decode(target: LogitsFn, prompt: Prefix, max_tokens: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(sample(target(prompt + tuple(out)), GREEDY, len(prompt) + len(out), rng=None))
    return out


def greedy_speculative_decode(target: LogitsFn, draft: LogitsFn, prompt: Prefix, k: int,
                              max_tokens: int) -> tuple[list[int], int]:
    """Draft k tokens by the draft's argmax, verify them in one pass of target rows, emit; and count the steps."""
    out, steps = [], 0
    while len(out) < max_tokens:
        context, drafts = prompt + tuple(out), []
        for _ in range(k):
            drafts.append(sample(draft(context + tuple(drafts)), GREEDY, len(context) + len(drafts), rng=None))
        logits = np.stack([target(context + tuple(drafts[:i])) for i in range(k + 1)])
        out += rejection_sample(drafts, None, target_probs_from_logits(logits, GREEDY, out, drafts), rng=None)
        steps += 1
    return out[:max_tokens], steps


@given(st.integers(0, 2**32), st.integers(2, 8), st.integers(1, 4), st.sampled_from(["agree", "disagree", "part"]))
def test_greedy_speculative_decoding_equals_greedy_decoding(seed, vocab_size, k, agreement):
    target = TinyModel(seed, vocab_size).logits
    disagree = lambda prefix: -target(prefix)  # its argmax is never the target's
    draft = {"agree": target, "disagree": disagree,
             "part": lambda prefix: target(prefix) if hash(prefix) % 3 else disagree(prefix)}[agreement]
    plain = greedy_decode(target, (1,), 12)
    speculative, steps = greedy_speculative_decode(target, draft, (1,), k, 12)
    assert speculative == plain
    if agreement != "part":  # all k accepted plus the bonus, or only the target's own token
        assert steps == (math.ceil(12 / (k + 1)) if agreement == "agree" else 12)


def test_greedy_verification_draws_nothing_whatever_the_draft_distribution():
    rng = np.random.default_rng(0)
    target = np.eye(4)[[2, 0, 3]]  # one-hot rows: greedy
    for _ in range(20):
        draft_probs = rng.dirichlet(np.ones(4), size=2)
        drafts = [int(rng.choice(4, p=q)) for q in draft_probs]
        emitted = rejection_sample(drafts, draft_probs, target, rng=None)
        assert emitted == [2, 0, 3][:len(emitted)]


def test_target_rows_are_the_samplers_distributions_with_the_drafts_in_the_context():
    logits = np.random.default_rng(5).normal(size=(3, 6))
    params = SamplingParams(temperature=0.7, top_k=4, bad_words_token_ids=((2, 5),))
    rows = target_probs_from_logits(logits, params, output_ids=[1], draft_token_ids=[2, 3])
    assert rows[0][5] > 0 and rows[1][5] == 0  # the bad word [2, 5]: 5 is banned right after the draft 2
    assert np.allclose(rows[2], filtered_probs(processed_logits(logits[2], params, [1, 2, 3]), params))
    greedy_rows = target_probs_from_logits(logits, GREEDY, [1], [2, 3])
    assert greedy_rows.tolist() == np.eye(6)[np.argmax(logits, axis=1)].tolist()


# ------------------------------------------------------------------------------------- n-gram proposer
@pytest.mark.parametrize("tokens, k, lookup_min, lookup_max, expected", [
    # the longest n wins: the 4-gram [1, 2, 3, 4] matches, so not what follows the 3-gram [2, 3, 4] ([5, 1])
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 2, 3, 4, [1, 2]),
    # only the shortest allowed suffix [2, 3] occurs earlier
    ([1, 2, 3, 9, 2, 3], 2, 2, 4, [9, 2]),
    # no earlier occurrence of any allowed suffix
    ([1, 2, 3, 4, 5], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 2, 4, 4, []),
    # fewer than k tokens follow the match before the context ends
    ([1, 2, 3, 4, 1, 2, 3], 5, 2, 2, [4, 1, 2, 3]),
    # several earlier occurrences: vLLM takes the first (leftmost)
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 2, 3, 3, [100, 1]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 1, 1, [6, 2]),
    # an earlier occurrence may overlap the suffix itself
    ([1, 1, 1, 1], 4, 1, 3, [1]),
    # a context shorter than prompt_lookup_min + 1 has nothing earlier to match
    ([5, 5], 3, 2, 3, []),
])
def test_propose_ngram_follows_vllm(tokens, k, lookup_min, lookup_max, expected):
    assert propose_ngram(tokens, k, lookup_min, lookup_max) == expected


def test_propose_ngram_stops_at_max_model_len_and_refuses_bad_lengths():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 3, 2, 2, max_model_len=8) == [4]
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 3, 2, 2, max_model_len=7) == []
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        propose_ngram([1, 2], 2, 0, 2)
