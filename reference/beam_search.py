"""Beam search, the plain way: every beam recomputed from scratch, no sharing. The engine's oracle.

The rules are vLLM's: each step, every live beam proposes its 2 x beam_width most likely tokens;
proposals ending in EOS are set aside as completed; the best beam_width others (by cumulative
log-probability) live on. After max_tokens, completed and live beams are ranked by
cum_logprob / length ** length_penalty (EOS not counted in the length) and the best beam_width returned.
"""

from collections.abc import Sequence

import numpy as np

from reference.llama import LlamaModel


def log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def beam_score(tokens: list[int], cum_logprob: float, eos_token_ids: Sequence[int], length_penalty: float) -> float:
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / length**length_penalty


def beam_search(model: LlamaModel, prompt: list[int], beam_width: int, max_tokens: int,
                eos_token_ids: Sequence[int] = (), length_penalty: float = 1.0) -> list[tuple[list[int], float]]:
    """Returns the best beams as (prompt + generated tokens, cumulative logprob), best first."""
    beams: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    completed: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        proposals = []
        for tokens, cum in beams:
            logprobs = log_softmax(model.last_logits(tokens).astype(np.float64))
            for token in np.argsort(-logprobs, kind="stable")[: 2 * beam_width]:
                proposal = (tokens + [int(token)], cum + float(logprobs[token]))
                (completed if int(token) in eos_token_ids else proposals).append(proposal)
        beams = sorted(proposals, key=lambda b: b[1], reverse=True)[:beam_width]
    ranked = sorted(completed + beams, key=lambda b: beam_score(b[0], b[1], eos_token_ids, length_penalty),
                    reverse=True)
    return ranked[:beam_width]
