"""Speculative decoding: a cheap proposer drafts k tokens, the target scores them in one forward pass,
and a rejection sampler keeps a prefix of them.

The rule is Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and
Chen et al. 2023 ("Accelerating Large Language Model Decoding with Speculative Sampling"). Draft x_i,
drawn from the draft's distribution q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)),
where p_i is the target's distribution at that position. At the first rejection the step emits one
token drawn from norm(max(0, p_i - q_i)) and stops; if all k are accepted it emits a bonus token
from p_k, which the same forward pass computed. So a step emits 1..k+1 tokens.

Why it is exact: at each position the emitted token is x with probability

    q(x) min(1, p(x)/q(x))  +  P(reject) max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y))
  = min(p(x), q(x))         +  max(0, p(x) - q(x))  = p(x),

because P(reject) = 1 - sum_y min(p(y), q(y)) = sum_y max(0, p(y) - q(y)). Each token follows the
target given the tokens before it, whatever the draft: a poor draft costs speed, never quality.
Greedy decoding is the case where every p is one-hot at the target's argmax: a draft survives exactly
while it equals that argmax, and the first disagreement emits the argmax, so no draw is needed.

The n-gram proposer drafts deterministically (its q is one-hot); a draft model samples its drafts from
its own q and passes q along.
"""

from collections.abc import Sequence

import numpy as np

from reference.llama import LlamaModel
from reference.request import SamplingParams
from reference.sampler import filtered_probs, processed_logits


def propose_ngram(token_ids: Sequence[int], num_speculative_tokens: int, prompt_lookup_min: int,
                  prompt_lookup_max: int, max_model_len: int | None = None) -> list[int]:
    """Prompt-lookup drafting: copy what followed an earlier occurrence of the context's last n tokens.

    vLLM's rule (vllm/v1/spec_decode/ngram_proposer.py): the longest n in [prompt_lookup_min, prompt_lookup_max] whose
    last-n-token suffix occurs earlier in the context wins; of that n-gram's earlier occurrences the
    first (leftmost) is used. The earlier occurrence may overlap the suffix itself. It proposes the
    tokens that follow the occurrence: `num_speculative_tokens` of them, fewer where the context ends
    first, and none past `max_model_len`.

    Args:
        token_ids: the context so far (prompt and output).
        num_speculative_tokens: k, the most tokens to propose.
        prompt_lookup_min: the shortest suffix worth matching (>= 1).
        prompt_lookup_max: the longest suffix tried first.
        max_model_len: if given, the context plus the drafts stays within it.

    Returns:
        The drafted tokens, [] when no suffix of an allowed length occurs earlier.
    """
    if not 1 <= prompt_lookup_min <= prompt_lookup_max or num_speculative_tokens < 0:
        raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max and num_speculative_tokens >= 0; got "
                         f"{prompt_lookup_min}, {prompt_lookup_max}, {num_speculative_tokens}")
    tokens, k = list(token_ids), num_speculative_tokens
    if max_model_len is not None:
        k = max(0, min(k, max_model_len - len(tokens)))
    # An earlier occurrence starts at s <= len - n - 1, so that at least one token follows it.
    # --8<-- [start:ngram]
    for n in range(min(prompt_lookup_max, len(tokens) - 1), prompt_lookup_min - 1, -1):
        suffix = tokens[-n:]
        start = next((s for s in range(len(tokens) - n)
                      if tokens[s : s + n] == suffix), None)
        if start is not None:
            return tokens[start + n : start + n + k]
    return []
    # --8<-- [end:ngram]


class NgramProposer:
    """vLLM's method "ngram" (prompt lookup): drafts copied from the request's own context, free to propose.

    vLLM's defaults: prompt_lookup_min and prompt_lookup_max are 5 when neither is given.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 5, prompt_lookup_max: int = 5) -> None:
        propose_ngram([], num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)  # checks the arguments
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min, self.prompt_lookup_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """At most min(k, max_drafts) drafts to follow `token_ids`."""
        k = min(self.num_speculative_tokens, max_drafts)
        return propose_ngram(token_ids, k, self.prompt_lookup_min, self.prompt_lookup_max)


class DraftModelProposer:
    """A cheaper model with the target's vocabulary drafts k tokens, each its own argmax (as vLLM's draft models
    propose): a deterministic proposer, so its q is one-hot and `rejection_sample` takes draft_probs=None.

    It recomputes the whole context for every draft (`last_logits`): slow and simple, as an oracle may be.
    """

    def __init__(self, model: LlamaModel, num_speculative_tokens: int) -> None:
        self.model, self.num_speculative_tokens = model, num_speculative_tokens

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        drafts: list[int] = []
        for _ in range(min(self.num_speculative_tokens, max_drafts)):
            drafts.append(int(np.argmax(self.model.last_logits([*token_ids, *drafts]))))
        return drafts


def acceptance_probability(target_prob: float, draft_prob: float) -> float:
    """min(1, p(x) / q(x)) for a draft x the proposer drew, so q(x) > 0."""
    assert draft_prob > 0, "a drafted token must have positive draft probability"
    return min(1.0, target_prob / draft_prob)


def residual_distribution(target_probs: np.ndarray, draft_probs: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)): what a rejection samples from, the mass the target has and the draft lacks."""
    residual = np.maximum(target_probs - draft_probs, 0.0)
    # NOTE: a rejection implies p(x) < q(x), so the residual has mass in exact arithmetic; an all-zero one
    # comes only from rounding where p and q agree, and then p is the right distribution.
    return residual / residual.sum() if residual.sum() > 0 else target_probs


def rejection_sample(draft_token_ids: Sequence[int], draft_probs: np.ndarray | None, target_probs: np.ndarray,
                     rng: np.random.Generator | None) -> list[int]:
    """Verify k drafted tokens against the target; emit what survives and one token from the target.

    Draws from `rng`: one `rng.random()` per draft whose acceptance is uncertain (0 < p(x) < q(x)), in
    order, then one `rng.choice` for the last emitted token unless its distribution has a single token.
    Greedy (one-hot target rows) therefore draws nothing, and `rng` may be None.

    Args:
        draft_token_ids: the k drafted tokens x_0..x_{k-1} (k may be 0).
        draft_probs: [k, V], row i the draft distribution x_i was drawn from; None for a deterministic
            proposer such as n-gram, whose q is one-hot at x_i.
        target_probs: [k + 1, V], row i the target's distribution given the context and x_<i; row k is
            the bonus position after the last draft.
        rng: the source of the draws above.

    Returns:
        The emitted tokens, 1..k+1 of them: the accepted drafts, then the residual's or the bonus token.
    """
    k, vocab_size = len(draft_token_ids), target_probs.shape[1]
    assert target_probs.shape[0] == k + 1, f"target_probs needs k + 1 = {k + 1} rows, got {target_probs.shape}"
    # --8<-- [start:rejection_sample]
    if draft_probs is None:
        draft_probs = np.eye(vocab_size)[list(draft_token_ids)].reshape(k, vocab_size)
    emitted: list[int] = []
    for i, x in enumerate(draft_token_ids):
        p, q = target_probs[i], draft_probs[i]
        if not _accepted(acceptance_probability(p[x], q[x]), rng):
            return emitted + [_draw(residual_distribution(p, q), rng)]
        emitted.append(int(x))
    return emitted + [_draw(target_probs[k], rng)]
    # --8<-- [end:rejection_sample]


def target_probs_from_logits(logits: np.ndarray, params: SamplingParams, output_ids: Sequence[int],
                             draft_token_ids: Sequence[int]) -> np.ndarray:
    """The [k + 1, V] rows `rejection_sample` verifies against, from the target's logits at the k + 1
    positions of one verification pass: the sampler's controls and filters, one-hot at the argmax when
    greedy (the sampler's tie rule), so greedy speculation emits exactly what greedy sampling would."""
    rows = []
    for i, row in enumerate(logits):
        row = processed_logits(row, params, [*output_ids, *draft_token_ids[:i]])  # bad words see the drafts
        rows.append(np.eye(len(row))[np.argmax(row)] if params.greedy else filtered_probs(row, params))
    return np.stack(rows)


def _accepted(probability: float, rng: np.random.Generator | None) -> bool:
    if probability >= 1.0 or probability <= 0.0:
        return probability >= 1.0  # certain either way: no draw, so greedy needs no generator
    assert rng is not None, "an uncertain acceptance needs a generator"
    return bool(rng.random() < probability)


def _draw(probs: np.ndarray, rng: np.random.Generator | None) -> int:
    support = np.flatnonzero(probs)
    if len(support) == 1:
        return int(support[0])
    assert rng is not None, "sampling from a distribution with several tokens needs a generator"
    return int(rng.choice(len(probs), p=probs))
