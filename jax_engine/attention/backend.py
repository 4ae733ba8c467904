"""The attention backend interface and the metadata every backend receives.

A step's new tokens are flat, decode sequences first, then prefill chunks:

    tokens  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 | pad ... ]      T rows (bucketed)
    seqs    [ d0 d1 d2 pad | p0 p1 ]                           B = Bd + Bp sequences (each part bucketed)

A backend writes each token's new K/V at `slot_mapping` first, then attends over every sequence's block
table up to its context length, causal within a chunk:

    attention(q [T, N, D], k [T, K, D], v [T, K, D], k_cache [L, S, K, D], v_cache, layer, metadata,
              block_size, scale) -> (out [T, N, D], k_cache, v_cache)
"""

import logging
from collections.abc import Callable
from typing import NamedTuple

import jax


class AttentionMetadata(NamedTuple):
    positions: jax.Array  # [T] position of each token in its sequence
    slot_mapping: jax.Array  # [T] cache slot of each token's K/V; padding = num_slots (dropped)
    block_tables: jax.Array  # [B, C] physical block ids (padding rows point at block 0)
    seq_lens: jax.Array  # [B] context length including this step's tokens; 0 for padding
    query_start_loc: jax.Array  # [B + 1] where each sequence's tokens start (padding sequences: 0 tokens)
    decode_token_index: jax.Array  # [Bd] row of each decode sequence's single token
    prefill_token_index: jax.Array  # [Bp, Qp] rows of each prefill chunk; padding = T (out of range)


logger = logging.getLogger(__name__)

AttentionFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]

ATTENTION_BACKENDS = ("auto", "xla", "cpu", "pallas")
# Backends that find each token's sequence through query_start_loc and read a block table only up to the
# token's position: the model runner gives them no padded per-kind rows (decode_token_index and
# prefill_token_index are empty) and one table width.
RAGGED_BACKENDS = ("cpu",)


def get_attention_backend(name: str, platform: str) -> tuple[str, AttentionFn]:
    """Resolve "auto" and return (name, attention function).

    "auto" is pallas on GPU, the cpu kernel backend on CPU when its kernel builds, and xla otherwise.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        name = "pallas" if platform == "gpu" else "cpu" if platform == "cpu" and _cpu_kernel_ready() else "xla"
    if name == "pallas":  # interpreted on CPU: exact but slow, for tests
        from jax_engine.attention.pallas import make_backend

        return name, _cached_pallas(platform, make_backend)
    if name == "cpu":
        from jax_engine.attention.cpu import kernel_unavailable_reason, paged_attention

        reason = f"it runs on CPU, not {platform!r}" if platform != "cpu" else kernel_unavailable_reason()
        if reason:
            raise ValueError(f"attention_backend 'cpu' is unavailable: {reason}")
        return name, paged_attention
    from jax_engine.attention.xla import paged_attention

    return name, paged_attention


def _cpu_kernel_ready() -> bool:
    from jax_engine.attention.cpu import kernel_unavailable_reason

    reason = kernel_unavailable_reason()
    if reason:
        logger.warning("CPU paged-attention kernel unavailable, using the xla backend: %s", reason)
    return reason is None


_PALLAS_BACKENDS: dict[str, AttentionFn] = {}


def _cached_pallas(platform: str, make_backend) -> AttentionFn:
    # One function object per platform, so every engine shares the jit cache of the step function.
    return _PALLAS_BACKENDS.setdefault(platform, make_backend(platform))
