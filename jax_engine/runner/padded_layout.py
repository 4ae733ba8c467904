"""The padded layout's rows (attention backends that are not ragged, see AttentionBackend.ragged): each kind of
sequence, decode and prefill, padded to its own bucket, so a step's shapes take few distinct values.
"""

import numpy as np

from jax_engine.buckets import bucket


def padded_table_rows(num_decode: int, num_prefill: int) -> tuple[list[int], int]:
    """(the block-table row of each sequence, decode then prefill; the rows in all) on the padded layout:

        rows [ d0 d1 d2 pad pad pad pad pad | p0 p1 ]   each kind's rows bucketed, decode to at least 8

    Padding a few decode rows costs far less than a compile per batch size as a batch drains (1, 2, 4 would
    each compile the whole model once more)."""
    decode_rows = bucket(num_decode, 8)
    return [*range(num_decode), *range(decode_rows, decode_rows + num_prefill)], decode_rows + bucket(num_prefill)


def padded_kind_rows(decode_starts: list[int], prefill_chunks: list[tuple[int, int]],
                     padded_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The padded layout's token rows of each decode sequence [Bd] and of each prefill chunk [Bp, Qp], from the
    row of each decode token and the (first row, length) of each chunk; padding rows hold padded_tokens (past
    the last token). Bd, Bp and Qp are bucketed as in padded_table_rows."""
    decode_rows = np.full(bucket(len(decode_starts), 8), padded_tokens, np.int32)
    decode_rows[: len(decode_starts)] = decode_starts
    max_chunk = bucket(max((length for _, length in prefill_chunks), default=0), 8)
    prefill_rows = np.full((bucket(len(prefill_chunks)), max_chunk), padded_tokens, np.int32)
    for j, (first, length) in enumerate(prefill_chunks):
        prefill_rows[j, :length] = np.arange(first, first + length)
    return decode_rows, prefill_rows
