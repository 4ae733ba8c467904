"""Prompt-lookup drafting in NumPy: the oracle's rule (reference.speculative.propose_ngram), vectorized.

Every step asks it once per decoding sequence, over the whole context: the oracle's Python scan costs
milliseconds at a few thousand tokens, this one compares all windows of one length at once.
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], num_drafts: int, prompt_lookup_min: int, prompt_lookup_max: int) -> list[int]:
    """The tokens that followed the leftmost earlier occurrence of the longest matching suffix (n from
    prompt_lookup_max down to prompt_lookup_min): at most `num_drafts` of them, [] when nothing matches."""
    if num_drafts <= 0:
        return []
    tokens = np.asarray(token_ids, np.int64)
    for n in range(min(prompt_lookup_max, len(tokens) - 1), prompt_lookup_min - 1, -1):
        # Windows starting at 0 .. len - n - 1: each has at least one token after it.
        windows = sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(matches):
            start = int(matches[0]) + n
            return tokens[start : start + num_drafts].tolist()
    return []
