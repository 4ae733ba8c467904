"""Reference paged attention equals dense causal softmax attention, whatever the block layout, with or
without a sliding window, ALiBi and a soft cap; and each does what it says on cases checked by hand."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference import AttentionMetadata, dense_attention, paged_attention, write_kv
from tests.kernel_cases import Variant, variants


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


@given(batches(), variants())
def test_paged_attention_matches_dense_attention(batch, variant: Variant):
    block_size, num_kv_heads, group, head_dim, seqs, seed = batch
    options = variant.kwargs(num_kv_heads * group)
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
        expected.append(dense_attention(q, k, v, scale=head_dim**-0.5, **options))
        queries.append(q)
        tables.append(table)
        slots.extend(seq_slots[seq_len - new :])
        starts.append(starts[-1] + new)
    metadata = AttentionMetadata(np.array(slots), np.array(starts), np.array([s for s, _ in seqs]), tables)
    out = paged_attention(np.concatenate(queries), k_cache, v_cache, metadata, scale=head_dim**-0.5, **options)
    diff = np.abs(out - np.concatenate(expected)).max()
    assert diff < 1e-10, f"max difference {diff}"  # float64 throughout: only rounding differs


def test_dense_attention_of_one_key_returns_its_value():
    v = np.arange(4.0).reshape(1, 1, 4)
    assert np.array_equal(dense_attention(np.ones((1, 2, 4)), np.ones((1, 1, 4)), v, 0.5), np.repeat(v, 2, axis=1))


def one_sequence(seq_len: int, block_size: int, seed: int = 0):
    """(queries of every position [n, 2, 4], keys, values [n, 1, 4], a shuffled cache, its metadata)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((seq_len, 2, 4))
    k, v = rng.standard_normal((seq_len, 1, 4)), rng.standard_normal((seq_len, 1, 4))
    num_blocks = -(-seq_len // block_size)
    table = [int(b) for b in rng.permutation(num_blocks)]
    slots = np.array([table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
    k_cache, v_cache = np.zeros((num_blocks, block_size, 1, 4)), np.zeros((num_blocks, block_size, 1, 4))
    write_kv(k_cache, v_cache, k, v, slots)
    return q, k, v, k_cache, v_cache, AttentionMetadata(slots, np.array([0, seq_len]), np.array([seq_len]), [table])


def test_window_of_one_returns_each_querys_own_value():
    q, k, v, k_cache, v_cache, metadata = one_sequence(seq_len=11, block_size=4)
    own = np.repeat(v, 2, axis=1)  # both query heads read the one KV head
    assert np.allclose(paged_attention(q, k_cache, v_cache, metadata, 0.5, sliding_window=1), own)
    assert np.allclose(dense_attention(q, k, v, 0.5, sliding_window=1), own)


def test_window_ignores_keys_before_it():
    """A window of 3: the blocks wholly before it are never read (NaN there changes nothing), and the output is
    attention over the last 3 keys alone; a window of 4 gives another."""
    q, k, v, k_cache, v_cache, metadata = one_sequence(seq_len=9, block_size=2)
    last = AttentionMetadata(metadata.slot_mapping[-1:], np.array([0, 1]), metadata.seq_lens, metadata.block_tables)
    table = metadata.block_tables[0]
    want = dense_attention(q[-1:], k[-3:], v[-3:], 0.5)  # the last query over its last 3 keys only
    k_cache[table[:3]], v_cache[table[:3]] = np.nan, np.nan  # positions 0..5: blocks 0-2 are wholly outside
    out = paged_attention(q[-1:], k_cache, v_cache, last, 0.5, sliding_window=3)
    assert np.allclose(out, want)
    assert np.allclose(dense_attention(q[-1:], k, v, 0.5, sliding_window=3), want)
    assert not np.allclose(dense_attention(q[-1:], k, v, 0.5, sliding_window=4), want)


@pytest.mark.parametrize("slope, position", [(1e4, "own"), (-1e4, "first")])
def test_steep_alibi_attends_to_one_position(slope, position):
    """slope * (t - p): a steep positive slope leaves only the query's own key (distance 0), a steep negative
    one only the furthest visible key: position 0, or the window's first position."""
    q, k, v, k_cache, v_cache, metadata = one_sequence(seq_len=10, block_size=4)
    slopes = np.array([slope, slope])
    own = np.repeat(v, 2, axis=1)
    for window in (None, 3):
        first = [0 if window is None else max(0, p - window + 1) for p in range(10)]
        want = own if position == "own" else own[first]
        out = paged_attention(q, k_cache, v_cache, metadata, 0.5, sliding_window=window, alibi_slopes=slopes)
        assert np.allclose(out, want)
        assert np.allclose(dense_attention(q, k, v, 0.5, sliding_window=window, alibi_slopes=slopes), want)


def test_alibi_adds_slope_times_distance_to_each_heads_scores():
    """Two keys, zero scores: the weights are softmax([-slope, 0]) per head, so each head's output is known."""
    v = np.array([[[0.0]], [[1.0]]])  # [2 keys, 1 KV head, d=1]
    slopes = np.array([0.0, np.log(3.0)])  # head 0 averages; head 1 weighs the own key 3:1
    out = dense_attention(np.zeros((1, 2, 1)), np.zeros((2, 1, 1)), v, 1.0, alibi_slopes=slopes)
    assert np.allclose(out[0, :, 0], [0.5, 0.75])


def test_a_soft_cap_squashes_each_scaled_score_before_alibi_is_added():
    """One query, two keys with scaled scores 0 and 4 (values 0 and 1): uncapped the weights are softmax([0, 4]);
    capped at 2 the second score is 2 tanh(2); ALiBi of slope s then adds -s to the first key's."""
    q, k, v = np.array([[[1.0]]]), np.array([[[0.0]], [[4.0]]]), np.array([[[0.0]], [[1.0]]])

    def second_weight(first_score, second_score):  # the output: the second key's weight times its value 1
        return np.exp(second_score) / (np.exp(first_score) + np.exp(second_score))

    assert np.isclose(dense_attention(q, k, v, 1.0)[0, 0, 0], second_weight(0, 4))
    capped = 2 * np.tanh(2.0)
    assert np.isclose(dense_attention(q, k, v, 1.0, logits_soft_cap=2.0)[0, 0, 0], second_weight(0, capped))
    out = dense_attention(q, k, v, 1.0, logits_soft_cap=2.0, alibi_slopes=np.array([0.5]))
    assert np.isclose(out[0, 0, 0], second_weight(-0.5, capped))


def test_write_kv_puts_each_token_at_its_slot():
    k_cache, v_cache = np.zeros((3, 2, 1, 1)), np.zeros((3, 2, 1, 1))
    write_kv(k_cache, v_cache, np.array([[[7.0]], [[8.0]]]), np.array([[[1.0]], [[2.0]]]), np.array([5, 0]))
    assert k_cache[2, 1, 0, 0] == 7 and k_cache[0, 0, 0, 0] == 8 and v_cache[2, 1, 0, 0] == 1
