"""Turning one row of logits into the next token: greedy, or filtered sampling.

First the request's token controls change the logits (allowed tokens, bad words, logit bias); then the
filters follow vLLM's order: temperature, then top-k, top-p and min-p on the probabilities, then a
draw. A seeded request draws from `numpy.random.default_rng([seed, position])`, so its token at a given
position never depends on what else shares the batch, or on preemption.
"""

from collections.abc import Sequence

import numpy as np

from reference.request import SamplingParams


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def processed_logits(logits: np.ndarray, params: SamplingParams, output_ids: Sequence[int] = ()) -> np.ndarray:
    """The logits after the token controls, in vLLM's order: allowed tokens, bad words, logit bias."""
    logits = np.array(logits, np.float64)
    if params.allowed_token_ids is not None:
        allowed = np.zeros(len(logits), bool)
        allowed[list(params.allowed_token_ids)] = True
        logits[~allowed] = -np.inf
    output_ids = list(output_ids)
    for *prefix, last in params.bad_words_token_ids:  # banned where the output already ends with the rest
        if len(prefix) <= len(output_ids) and output_ids[len(output_ids) - len(prefix):] == prefix:
            logits[last] = -np.inf
    for token, bias in (params.logit_bias or {}).items():
        logits[token] += bias
    return logits


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities after temperature, top-k, top-p and min-p (zeros for removed tokens)."""
    probs = softmax(logits.astype(np.float64) / params.temperature)
    if params.top_k > 0:
        kth_largest = np.sort(probs)[-min(params.top_k, len(probs))]
        probs = np.where(probs >= kth_largest, probs, 0.0)
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]  # mass of strictly more likely tokens
        keep = np.zeros_like(probs, dtype=bool)
        keep[order] = before < params.top_p * probs.sum()  # smallest set reaching top_p; >= 1 token
        probs = np.where(keep, probs, 0.0)
    if params.min_p > 0.0:
        probs = np.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def sample(logits: np.ndarray, params: SamplingParams, position: int, rng: np.random.Generator,
           output_ids: Sequence[int] = ()) -> int:
    """The next token for one request, sampled at `position` (the request's current length).

    `rng` is the engine's generator, used only by unseeded requests; bad words look at `output_ids`.
    """
    logits = processed_logits(logits, params, output_ids)
    if params.greedy:
        return int(np.argmax(logits))  # ties go to the lowest token id
    if params.seed is not None:
        rng = np.random.default_rng([params.seed % 2**64, position])  # seeds may be negative
    probs = filtered_probs(logits, params)
    return int(rng.choice(len(probs), p=probs))
