"""The attention backend interface and the metadata every backend receives.

A step's new tokens are flat, decode sequences first, then prefill chunks:

    tokens  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 | pad ... ]      T rows (bucketed)
    seqs    [ d0 d1 d2 pad | p0 p1 ]                           B = Bd + Bp sequences (each part bucketed)

A backend writes each token's new K/V at `slot_mapping` first, then attends over every sequence's block
table up to its context length, causal within a chunk.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax


class AttentionMetadata(NamedTuple):
    positions: jax.Array  # [T] position of each token in its sequence
    slot_mapping: jax.Array  # [T] cache slot of each token's K/V; padding = num_slots (dropped)
    block_tables: jax.Array  # [B, C] physical block ids (padding rows point at block 0)
    seq_lens: jax.Array  # [B] context length including this step's tokens; 0 for padding
    query_start_loc: jax.Array  # [B + 1] where each sequence's tokens start in the flat batch
    decode_token_index: jax.Array  # [Bd] row of each decode sequence's single token
    prefill_token_index: jax.Array  # [Bp, Qp] rows of each prefill chunk; padding = T (out of range)


# attention(q [T, N, D], k_cache [L, S, K, D], v_cache [L, S, K, D], layer, metadata, block_size, scale)
#   -> [T, N, D]
AttentionFn = Callable[..., jax.Array]

ATTENTION_BACKENDS = ("auto", "xla", "pallas")


def get_attention_backend(name: str, platform: str) -> tuple[str, AttentionFn]:
    """Resolve "auto" (pallas on GPU, xla elsewhere) and return (name, attention function)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        name = "xla"  # the Pallas kernels are the next issue; until then every platform uses xla
    if name == "pallas":
        raise ValueError("attention_backend='pallas' is not available yet: the Pallas kernels are not built")
    from jax_engine.attention.xla import paged_attention

    return name, paged_attention
