"""Pallas kernels against the NumPy reference (and jax's own Pallas paged attention for decode).

On CPU the kernels run in the Pallas interpreter; on a GPU the same tests run them compiled.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from tests.kernel_cases import Variant, expected, float32_tolerance, make_case, paged_batches, variants

INTERPRET = jax.default_backend() != "gpu"
FEW = settings(max_examples=max(settings.default.max_examples // 8, 4))  # each new shape compiles


@FEW
@given(paged_batches(decode_only=True), st.sampled_from([1, 2, 4]), variants())
# A window of 9 at position 19 reaches keys 11..19 in blocks 1-2 of 8 tokens; its first block rounds down to a
# step (2 blocks), so the one partition must walk blocks 0-2: the partition size must count the rounding.
@example(case=(8, 64, 4, 1, [20, 45, 0], [1, 1, 0], 3), num_partitions=1, variant=Variant(9, 3, 2.0))
def test_decode_kernel_matches_the_reference(case, num_partitions, variant: Variant):
    block_size, head_dim, group, num_kv_heads, seq_lens, q_lens, seed = case
    options = variant.kwargs(group * num_kv_heads)
    k, v, tables, q, starts = make_case(*case)
    padded_q = np.zeros((len(seq_lens), q.shape[1], head_dim), np.float32)
    padded_q[[i for i, n in enumerate(seq_lens) if n]] = q
    out = paged_decode_attention(jnp.array(padded_q), jnp.array(k), jnp.array(v), jnp.array(tables),
                                 jnp.array(seq_lens, jnp.int32), 1, num_partitions=num_partitions, interpret=INTERPRET,
                                 **options)
    want = np.zeros_like(padded_q)
    want[[i for i, n in enumerate(seq_lens) if n]] = expected(q, k, v, tables, seq_lens, starts, head_dim, **options)
    diff = np.abs(np.asarray(out) - want).max()
    # float32, with the softmax accumulated online block by block and partitions merged: another summation
    # order than the reference's; outputs are O(1), so differences are a few float32 ulps (~1e-6) interpreted.
    assert diff < float32_tolerance(v, max(seq_lens)), f"max difference {diff}"


@FEW
@given(paged_batches(decode_only=False), variants())
# The default model's GQA group (9 query heads over 3 KV heads) and a head dimension that is no power of two: both
# padded inside the kernel for Triton (pallas_kernels/_common.py).
@example(case=(16, 80, 3, 2, [40, 1, 0, 37], [17, 1, 0, 5], 2), variant=Variant(None, 5, 0.8))
def test_ragged_kernel_matches_the_reference(case, variant: Variant):
    block_size, head_dim, group, num_kv_heads, seq_lens, q_lens, seed = case
    options = variant.kwargs(group * num_kv_heads)
    k, v, tables, q, starts = make_case(*case)
    out = ragged_paged_attention(jnp.array(q), jnp.array(k), jnp.array(v), jnp.array(tables),
                                 jnp.array(seq_lens, jnp.int32), jnp.array(starts), 1,
                                 max_q_len=max(max(q_lens), 1), interpret=INTERPRET, **options)
    want = expected(q, k, v, tables, seq_lens, starts, head_dim, **options)
    diff = np.abs(np.asarray(out) - want).max(initial=0)
    assert diff < float32_tolerance(v, max(seq_lens)), f"max difference {diff}"  # online softmax, as decode's


def test_decode_kernel_matches_jax_pallas_paged_attention():
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_paged_attention

    rng = np.random.default_rng(0)
    batch, num_kv_heads, group, head_dim, block_size, num_blocks, per_seq = 3, 2, 8, 64, 16, 40, 8
    k = rng.standard_normal((1, num_blocks, block_size, num_kv_heads, head_dim), np.float32)
    v = rng.standard_normal(k.shape, np.float32)
    tables = rng.permutation(num_blocks)[: batch * per_seq].reshape(batch, per_seq).astype(np.int32)
    lens = np.array([1, 64, 128], np.int32)
    q = rng.standard_normal((batch, num_kv_heads * group, head_dim), np.float32)
    ours = paged_decode_attention(jnp.array(q), jnp.array(k), jnp.array(v), jnp.array(tables), jnp.array(lens),
                                  0, interpret=INTERPRET)
    pages = lambda x: jnp.array(x[0].transpose(2, 0, 1, 3))  # noqa: E731  [K, blocks, block_size, D]
    theirs = jax_paged_attention(jnp.array(q) * head_dim**-0.5, pages(k), pages(v), jnp.array(tables),
                                 jnp.array(lens), block_h=16, pages_per_compute_block=2, k_splits=2,
                                 interpret=INTERPRET)
    diff = np.abs(np.asarray(ours) - np.asarray(theirs)).max()
    print(f"max difference vs jax.experimental.pallas.ops.gpu.paged_attention: {diff:.2e}")
    # Both float32 online softmaxes, split and merged differently; compiled, both round their dots to TF32.
    assert diff < 2 * float32_tolerance(v, int(lens.max()))


def test_shape_errors_name_the_shapes():
    q, cache = jnp.zeros((2, 4, 64)), jnp.zeros((1, 4, 8, 3, 64))
    tables, lens = jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"q \(2, 4, 64\) does not fit the cache \(1, 4, 8, 3, 64\)"):
        paged_decode_attention(q, cache, cache, tables, lens, interpret=True)
    with pytest.raises(ValueError, match=r"must have the same shape"):
        paged_decode_attention(jnp.zeros((2, 3, 64)), cache, cache[:, :2], tables, lens, interpret=True)
    with pytest.raises(ValueError, match=r"query_start_loc \(2,\) must be \(3,\)"):
        ragged_paged_attention(jnp.zeros((2, 3, 64)), cache, cache, tables, lens, jnp.zeros(2, jnp.int32),
                               max_q_len=1, interpret=True)


def test_engine_pallas_backend_gives_the_xla_backends_greedy_tokens(make_llm):
    """The whole engine on the Pallas kernels against the jnp path (not "auto", which is Pallas itself on a GPU)."""
    from jax_engine import SamplingParams
    from tests.test_llm import PROMPTS

    args = dict(num_gpu_blocks_override=64, block_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128)
    pallas, xla = (make_llm(attention_backend=name, **args) for name in ("pallas", "xla"))
    assert (pallas.llm_engine.attention_backend.name, xla.llm_engine.attention_backend.name) == ("pallas", "xla")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in pallas.generate(PROMPTS, params, use_tqdm=False)]
    assert ours == [o.outputs[0].token_ids for o in xla.generate(PROMPTS, params, use_tqdm=False)]


def test_auto_backend_is_pallas_on_gpu():  # and on CPU, see test_cpu_kernel.py
    from jax_engine.attention import get_attention_backend

    assert get_attention_backend("auto", "gpu").name == "pallas"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        get_attention_backend("flash", "cpu")


@FEW
@given(num_tokens=st.integers(1, 12), num_kv_heads=st.sampled_from([1, 3]), head_dim=st.sampled_from([64, 128, 80]),
       seed=st.integers(0, 2**31))
@example(num_tokens=5, num_kv_heads=3, head_dim=80, seed=1)  # a padded head dimension: only its columns written
def test_write_kv_kernel_stores_each_token_at_its_slot(num_tokens, num_kv_heads, head_dim, seed):
    from pallas_kernels.write_kv import write_kv

    rng = np.random.default_rng(seed)
    num_slots = 32
    cache = rng.standard_normal((2, num_slots, num_kv_heads, head_dim), np.float32)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim), np.float32)
    slots = rng.choice(num_slots + 4, num_tokens, replace=False).astype(np.int32)  # some out of range: padding
    new_k, new_v = write_kv(jnp.array(k), jnp.array(-k), jnp.array(cache), jnp.array(cache), jnp.array(slots), 1,
                            interpret=INTERPRET)
    want_k, want_v = cache.copy(), cache.copy()
    for token, slot in enumerate(slots):
        if slot < num_slots:
            want_k[1, slot], want_v[1, slot] = k[token], -k[token]
    assert np.array_equal(np.asarray(new_k), want_k) and np.array_equal(np.asarray(new_v), want_v)
