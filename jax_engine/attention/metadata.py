"""The attention contract: the metadata every backend receives, and the function each provides.

A step's new tokens are flat, decode sequences first, then prefill chunks:

    tokens  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 | pad ... ]      T rows (bucketed)
    seqs    [ d0 d1 d2 pad | p0 p1 ]                           B = Bd + Bp sequences (each part bucketed)

A backend writes each token's new K/V at `slot_mapping` first, then attends over every sequence's block
table up to its context length, causal within a chunk:

    attention(q [T, N, D], k [T, K, D], v [T, K, D], k_cache [L, S, K, D], v_cache, layer, metadata,
              block_size, scale, *, sliding_window=None, alibi_slopes=None, logits_soft_cap=None)
        -> (out [T, N, D], k_cache, v_cache)

The keyword arguments come from the model's config; sliding_window is a Python int (static: part of the
compiled step) or, for a model whose layers differ, a traced int32 scalar (each layer's), alibi_slopes an array,
logits_soft_cap a Python float (static):
- sliding_window: int | None. The token at position p sees key position t only if p - sliding_window < t <= p,
  its last `sliding_window` keys, itself included (Mistral; Hugging Face's `kv_idx > q_idx - sliding_window`).
  None: plain causal. Backends that page may skip the blocks wholly before a token's window. Gemma 3 interleaves
  windowed and global layers in one scan: its global layers pass NO_WINDOW, a window no context reaches (the
  xla and cpu backends take a traced window; pallas's kernels need it static).
- alibi_slopes: float32 [N] or None, one slope per query head (BLOOM, MPT). The scaled score q.k * scale of
  position p and key position t in head h gets + alibi_slopes[h] * (t - p) before the softmax. (BLOOM adds
  slope * t, which differs by a constant per row: same softmax; t - p keeps numbers small at long positions.)
- logits_soft_cap: float | None (Gemma 2). Every scaled score s becomes cap * tanh(s / cap), before ALiBi.

This module imports no backend, so every backend imports it and backend.py picks among them.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax

AttentionFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
NO_WINDOW = 2**30  # a traced sliding_window that no context reaches: the global layers of a mixed model


@functools.partial(jax.tree_util.register_dataclass, meta_fields=("max_query_len",),
                   data_fields=("positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                                "decode_token_index", "prefill_token_index"))
@dataclass(frozen=True)
class AttentionMetadata:
    positions: jax.Array  # [T] position of each token in its sequence
    slot_mapping: jax.Array  # [T] cache slot of each token's K/V; padding = num_slots (dropped)
    block_tables: jax.Array  # [B, C] physical block ids (padding rows point at block 0)
    seq_lens: jax.Array  # [B] context length including this step's tokens; 0 for padding
    query_start_loc: jax.Array  # [B + 1] where each sequence's tokens start (padding sequences: 0 tokens)
    # The padded layout's per-kind rows (empty on the ragged layout, see AttentionBackend.ragged):
    decode_token_index: jax.Array  # [Bd] row of each decode sequence's single token
    prefill_token_index: jax.Array  # [Bp, Qp] rows of each prefill chunk; padding = T (out of range)
    # Static (part of the compiled shape): Qp, the bucketed longest prefill chunk; 1 when the step only decodes.
    # 0 on the ragged layout, whose backends need no bound (and so compile no shape per chunk length).
    max_query_len: int = 1


@dataclass(frozen=True)
class AttentionBackend:
    """One attention implementation and what the model runner must lay out for it."""

    name: str
    attend: AttentionFn  # the contract above; one object per backend, so engines share the step's jit cache
    # True: the backend finds each token's sequence through query_start_loc and reads a block table only up
    # to the token's position, so the runner gives it no per-kind rows and one table width. False: the
    # padded layout, with decode_token_index, prefill_token_index and max_query_len.
    ragged: bool
    default_block_size: int  # tokens per KV block where the user sets none
