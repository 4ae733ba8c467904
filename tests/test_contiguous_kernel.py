"""The contiguous-cache decode kernel (the yardstick of the paging overhead, paper Fig. 18a) against the
reference, and its lowering for CUDA.

A contiguous cache [L, B, T, K, D] is a paged one whose sequence b owns blocks b x T/bs .. (b + 1) x T/bs - 1
in order, so the reference's paged attention (and the paged kernel) read the same keys through that table.
On CPU the kernels run in the Pallas interpreter; on a GPU the same tests run them compiled.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.contiguous_decode_attention import contiguous_decode_attention
from pallas_kernels.paged_decode_attention import paged_decode_attention
from tests.kernel_cases import expected, float32_tolerance

INTERPRET = jax.default_backend() != "gpu"
FEW = settings(max_examples=max(settings.default.max_examples // 8, 4))  # each new shape compiles
TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


@st.composite
def contiguous_cases(draw):
    keys_per_step = draw(st.sampled_from([16, 32]))
    max_len = keys_per_step * draw(st.integers(1, 4))
    seq_lens = draw(st.lists(st.one_of(st.integers(1, max_len), st.just(max_len), st.just(0)), min_size=1,
                             max_size=4))
    return (keys_per_step, max_len, draw(st.sampled_from([64, 128])), draw(st.sampled_from([1, 3, 4, 8])),
            draw(st.sampled_from([1, 2])), seq_lens, draw(st.integers(0, 2**31)))


def as_paged(cache: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The contiguous cache [L, B, T, K, D] as a paged one [L, B x T/bs, bs, K, D] and each sequence's table."""
    layers, batch, max_len, num_kv_heads, head_dim = cache.shape
    per_seq = max_len // block_size
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    return cache.reshape(layers, batch * per_seq, block_size, num_kv_heads, head_dim), tables


@FEW
@given(contiguous_cases(), st.sampled_from([1, 2, 4]))
def test_contiguous_kernel_matches_the_reference(case, num_partitions):
    keys_per_step, max_len, head_dim, group, num_kv_heads, seq_lens, seed = case
    rng = np.random.default_rng(seed)
    shape = (2, len(seq_lens), max_len, num_kv_heads, head_dim)  # two layers: the kernel reads layer 1
    k, v = rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)
    for b, seq_len in enumerate(seq_lens):  # past each context: NaN, as a reused cache may hold (kernel_cases.py)
        k[1, b, seq_len:] = v[1, b, seq_len:] = np.nan
    q = rng.standard_normal((len(seq_lens), num_kv_heads * group, head_dim), np.float32)
    lens = np.array(seq_lens, np.int32)
    out = contiguous_decode_attention(jnp.array(q), jnp.array(k), jnp.array(v), jnp.array(lens), 1,
                                      num_partitions=num_partitions, keys_per_step=keys_per_step, interpret=INTERPRET)
    (paged_k, tables), (paged_v, _) = as_paged(k, 16), as_paged(v, 16)
    real = [i for i, n in enumerate(seq_lens) if n]
    starts = np.arange(len(real) + 1, dtype=np.int32)
    want = np.zeros_like(q)
    want[real] = expected(q[real], paged_k, paged_v, tables[real], lens[real], starts, head_dim)
    diff = np.abs(np.asarray(out) - want).max()
    print(f"max difference vs the reference: {diff:.2e}")
    assert diff < float32_tolerance(v, max(seq_lens)), f"max difference {diff}"  # online softmax, as paged


def test_contiguous_and_paged_kernels_agree_on_the_same_cache():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, 3, 128, 2, 64), np.float32)
    v = rng.standard_normal(k.shape, np.float32)
    q = rng.standard_normal((3, 8, 64), np.float32)
    lens = jnp.array([1, 77, 128], jnp.int32)
    ours = contiguous_decode_attention(jnp.array(q), jnp.array(k), jnp.array(v), lens, interpret=INTERPRET)
    (paged_k, tables), (paged_v, _) = as_paged(k, 16), as_paged(v, 16)
    paged = paged_decode_attention(jnp.array(q), jnp.array(paged_k), jnp.array(paged_v), jnp.array(tables), lens,
                                   interpret=INTERPRET)
    diff = np.abs(np.asarray(ours) - np.asarray(paged)).max()
    print(f"max difference vs the paged kernel: {diff:.2e}")
    assert diff < 2 * float32_tolerance(v, 128)  # compiled, both kernels round their dots to TF32


def test_shape_errors_name_the_shapes():
    q, cache, lens = jnp.zeros((2, 4, 64)), jnp.zeros((1, 2, 64, 2, 64)), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"k_cache \(1, 3, 64, 2, 64\) and seq_lens \(2,\) must have batch 2"):
        contiguous_decode_attention(q, cache[:, :1].repeat(3, 1), cache[:, :1].repeat(3, 1), lens, interpret=True)
    with pytest.raises(ValueError, match=r"length 48 \(k_cache \(1, 2, 48, 2, 64\)\) must be a multiple"):
        contiguous_decode_attention(q, cache[:, :, :48], cache[:, :, :48], lens, interpret=True)
    with pytest.raises(ValueError, match=r"keys_per_step 24 .* and head_dim 64 must be powers of two"):
        contiguous_decode_attention(q, cache, cache, lens, keys_per_step=24, interpret=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("batch, max_len, num_kv_heads, group", [(8, 512, 8, 4), (4, 256, 3, 3)])
def test_contiguous_kernel_lowers_for_cuda(dtype, batch, max_len, num_kv_heads, group):
    """The module a GPU would compile (Triton custom calls), built on this machine: the benchmark's shape
    (8 KV heads of 4 queries, head dim 128) and SmolLM2's (3 of 3, head dim 64)."""
    head_dim = 128 if num_kv_heads == 8 else 64
    q = jax.ShapeDtypeStruct((batch, num_kv_heads * group, head_dim), dtype)
    cache = jax.ShapeDtypeStruct((1, batch, max_len, num_kv_heads, head_dim), dtype)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    attend = jax.jit(lambda q, k, v, lens: contiguous_decode_attention(q, k, v, lens, num_partitions=16))
    exported = jax.export.export(attend, platforms=["cuda"], disabled_checks=[TRITON])(q, cache, cache, lens)
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()
    assert exported.out_avals[0].shape == (batch, num_kv_heads * group, head_dim)
