"""Reference paged attention equals dense causal softmax attention, whatever the block layout."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from reference import AttentionMetadata, dense_attention, paged_attention, write_kv


@st.composite
def batches(draw):
    """Sequences with a context, some new tokens (1 = decode, more = prefill chunk), in a shuffled cache."""
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    num_kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3, 4]))  # 1 = MHA, >1 = GQA (MQA when num_kv_heads == 1)
    head_dim = draw(st.sampled_from([4, 8, 16]))
    seqs = draw(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=4))
    seqs = [(seq_len, min(new, seq_len)) for seq_len, new in seqs]  # (context length, new tokens)
    return block_size, num_kv_heads, group, head_dim, seqs, draw(st.integers(0, 2**32 - 1))


@given(batches())
def test_paged_attention_matches_dense_attention(batch):
    block_size, num_kv_heads, group, head_dim, seqs, seed = batch
    rng = np.random.default_rng(seed)
    num_blocks = sum(-(-seq_len // block_size) for seq_len, _ in seqs) + 3
    physical = iter(rng.permutation(num_blocks))  # block tables point anywhere in the cache
    k_cache = np.full((num_blocks, block_size, num_kv_heads, head_dim), np.nan)  # NaN: reading garbage shows
    v_cache = np.full_like(k_cache, np.nan)
    queries, expected, tables, slots, starts = [], [], [], [], [0]
    for seq_len, new in seqs:
        table = [int(next(physical)) for _ in range(-(-seq_len // block_size))]
        k = rng.standard_normal((seq_len, num_kv_heads, head_dim))
        v = rng.standard_normal((seq_len, num_kv_heads, head_dim))
        q = rng.standard_normal((new, num_kv_heads * group, head_dim))
        seq_slots = np.array([table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        write_kv(k_cache, v_cache, k[: seq_len - new], v[: seq_len - new], seq_slots[: seq_len - new])  # context
        write_kv(k_cache, v_cache, k[seq_len - new :], v[seq_len - new :], seq_slots[seq_len - new :])  # this step
        expected.append(dense_attention(q, k, v, scale=head_dim**-0.5))
        queries.append(q)
        tables.append(table)
        slots.extend(seq_slots[seq_len - new :])
        starts.append(starts[-1] + new)
    metadata = AttentionMetadata(np.array(slots), np.array(starts), np.array([s for s, _ in seqs]), tables)
    out = paged_attention(np.concatenate(queries), k_cache, v_cache, metadata, scale=head_dim**-0.5)
    diff = np.abs(out - np.concatenate(expected)).max()
    assert diff < 1e-10, f"max difference {diff}"  # float64 throughout: only rounding differs


def test_dense_attention_of_one_key_returns_its_value():
    v = np.arange(4.0).reshape(1, 1, 4)
    assert np.array_equal(dense_attention(np.ones((1, 2, 4)), np.ones((1, 1, 4)), v, 0.5), np.repeat(v, 2, axis=1))


def test_write_kv_puts_each_token_at_its_slot():
    k_cache, v_cache = np.zeros((3, 2, 1, 1)), np.zeros((3, 2, 1, 1))
    write_kv(k_cache, v_cache, np.array([[[7.0]], [[8.0]]]), np.array([[[1.0]], [[2.0]]]), np.array([5, 0]))
    assert k_cache[2, 1, 0, 0] == 7 and k_cache[0, 0, 0, 0] == 8 and v_cache[2, 1, 0, 0] == 1
