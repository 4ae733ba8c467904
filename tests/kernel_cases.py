"""Random paged-attention cases shared by the kernel tests, and the reference's answer for them."""

from dataclasses import dataclass

import jax
import numpy as np
from hypothesis import strategies as st

from jax_engine.runner.attention_self_test import tolerance
from reference import AttentionMetadata, paged_attention

# On CPU the kernels run in the Pallas interpreter and xla takes float32 dots exactly (IEEE).
COMPILED = jax.default_backend() == "gpu"


def float32_tolerance(values: np.ndarray, keys: int, compiled: bool = COMPILED) -> float:
    """How far a float32 attention output may lie from the reference's on these value rows and contexts.

    Interpreted: only the online softmax's summation order differs, a few ulps of O(1) outputs (~1e-6 seen).
    Compiled on a GPU, Triton and xla round a float32 dot's inputs to TF32 (unit 2**-11): the engine's start-up
    self-test bound for compiled float32 (jax_engine/runner/attention_self_test.py), derived there for values in
    [-1, 1), scaled by these values' largest magnitude (outputs are convex combinations of value rows). Seen on
    an H200: 9e-4 with standard-normal values, against ~0.06 allowed; a wrong scale, window or slope is off by more.
    """
    if not compiled:
        return 2e-5
    return tolerance(np.float32, compiled=True, keys=keys) * float(np.nanmax(np.abs(values), initial=1.0))


@st.composite
def paged_batches(draw, decode_only: bool):
    block_size = draw(st.sampled_from([8, 16, 32]))
    head_dim = draw(st.sampled_from([64, 128, 80]))  # 80: not a power of two (GPT-NeoX 2.8B; Phi-3 has 96)
    group = draw(st.sampled_from([1, 3, 4, 8]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    # Context lengths: anything, 1, or exactly on a block boundary; 0 marks a padding sequence.
    length = st.one_of(st.integers(1, 70), st.just(1), st.integers(1, 4).map(lambda k: k * block_size))
    seq_lens = draw(st.lists(st.one_of(length, st.just(0)), min_size=1, max_size=4))
    q_lens = [min(n, 1) if decode_only else draw(st.integers(min(n, 1), n)) for n in seq_lens]
    return block_size, head_dim, group, num_kv_heads, seq_lens, q_lens, draw(st.integers(0, 2**31))


@dataclass(frozen=True)
class Variant:
    """Which keys a query sees and how they score: a sliding window, ALiBi, a soft cap, any of them or none."""

    sliding_window: int | None
    alibi_seed: int | None  # slopes are drawn once the case's number of heads is known
    # Scaled scores of these cases are about standard normal: caps of 0.5..5 squash them visibly.
    logits_soft_cap: float | None = None

    def kwargs(self, num_heads: int) -> dict:
        """The keyword arguments every attention implementation takes for this variant."""
        slopes = None
        if self.alibi_seed is not None:
            # Up to 1 per token, as BLOOM's steepest head (0.5) and more: a sign or head mix-up shows.
            slopes = np.random.default_rng(self.alibi_seed).uniform(0.0, 1.0, num_heads).astype(np.float32)
        return {"sliding_window": self.sliding_window, "alibi_slopes": slopes, "logits_soft_cap": self.logits_soft_cap}


def variants() -> st.SearchStrategy[Variant]:
    """No window or a window of 1..40 tokens (contexts run to 70: windows both cut and cover them); ALiBi or not;
    a soft cap or not."""
    return st.builds(Variant, st.one_of(st.none(), st.integers(1, 40)), st.one_of(st.none(), st.integers(0, 2**31)),
                     st.one_of(st.none(), st.floats(0.5, 5.0)))


def make_case(block_size, head_dim, group, num_kv_heads, seq_lens, q_lens, seed):
    rng = np.random.default_rng(seed)
    max_blocks = max(1, max(-(-n // block_size) for n in seq_lens))
    num_blocks = len(seq_lens) * max_blocks + 2
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)  # two layers: the kernels read layer 1
    k, v = rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)
    tables = rng.permutation(num_blocks)[: len(seq_lens) * max_blocks].reshape(len(seq_lens), max_blocks)
    # Every slot that no sequence may see (past its context, or in no sequence's table) holds NaN: a freed block
    # keeps whatever its last owner wrote, NaN included, and a kernel that weighs such a key by 0 still makes NaN.
    visible = np.zeros((num_blocks, block_size), bool)
    for table, seq_len in zip(tables, seq_lens):
        positions = np.arange(seq_len)
        visible[table[positions // block_size], positions % block_size] = True
    k[1][~visible] = v[1][~visible] = np.nan
    q = rng.standard_normal((sum(q_lens), num_kv_heads * group, head_dim), np.float32)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return k, v, tables.astype(np.int32), q, starts


def expected(q, k, v, tables, seq_lens, starts, head_dim, **variant):
    """The reference's output for the case's query rows (padding sequences' rows: zeros); `variant` is
    Variant.kwargs (sliding_window, alibi_slopes, logits_soft_cap)."""
    real = [i for i, n in enumerate(seq_lens) if n]
    out = np.zeros_like(q)
    md = AttentionMetadata(np.zeros(len(q), int), np.array([0] + [starts[i + 1] - starts[i] for i in real]).cumsum(),
                           np.array([seq_lens[i] for i in real]), [list(tables[i]) for i in real])
    rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in real]) if real else np.zeros(0, int)
    if real:
        out[rows] = paged_attention(q[rows], k[1], v[1], md, head_dim**-0.5, **variant)
    return out
