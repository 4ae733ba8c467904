"""allowed_token_ids as a bitmask over the vocabulary: the form the sampler's token mask takes (sampling_batch.py).

Made once per request, in NumPy, when the request is checked (input_processor.py).
"""

import numpy as np

from jax_engine.structured_output.grammar import bitmask_width


def allowed_token_mask(params, vocab_size: int) -> np.ndarray:
    """[bitmask_width] uint32: the bits of params.allowed_token_ids, made once per request (a request may
    list up to 2^20 ids; its rows then cost one AND per step)."""
    if getattr(params, "allowed_mask", None) is None:
        ids = np.unique(np.asarray(params.allowed_token_ids, np.int64))
        ids = ids[ids < vocab_size]
        row = np.zeros(bitmask_width(vocab_size), np.uint32)
        np.bitwise_or.at(row, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
        params._set("allowed_mask", row)
    return params.allowed_mask
