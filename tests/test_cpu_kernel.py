"""The CPU backend's C++ paged-attention kernel against the NumPy reference, its input checks, backend selection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_engine.attention import cpu, get_attention_backend, xla
from tests.kernel_cases import Variant, expected, make_case, paged_batches, variants

pytestmark = pytest.mark.skipif(cpu.kernel_unavailable_reason() is not None,
                                reason=f"no CPU kernel: {cpu.kernel_unavailable_reason()}")
CACHE_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2]
FEW = settings(max_examples=max(settings.default.max_examples // 4, 8))  # each new shape compiles


def run_kernel(q, k, v, tables, query_seq, context_lens, block_size, layer=1, **variant):
    """The kernel on [L, NB, bs, K, D] caches (flattened to slots, as the model passes them); `variant` is
    Variant.kwargs (sliding_window, alibi_slopes, logits_soft_cap)."""
    num_kv_heads, head_dim = k.shape[-2:]
    slots = lambda x: jnp.asarray(x).reshape(x.shape[0], -1, num_kv_heads, head_dim)  # noqa: E731
    out = cpu.attend_rows(jnp.asarray(q), slots(k), slots(v), jnp.int32(layer), jnp.asarray(tables),
                          jnp.asarray(query_seq, jnp.int32), jnp.asarray(context_lens, jnp.int32), block_size,
                          head_dim**-0.5, **variant)
    return np.asarray(out)


def kernel_case(case, cache_dtype=jnp.float32, **variant):
    """(query rows, the reference's output for them, caches, tables, each row's sequence and context length).

    Every sequence's chunk is its last q_len tokens; a padding sequence (seq_len 0) gets one padding row,
    which must come out zero. The caches hold `cache_dtype` values; the reference attends over exactly
    those values, widened. `variant` (Variant.kwargs) goes to the reference.
    """
    block_size, head_dim, _, _, seq_lens, q_lens, _ = case
    k, v, tables, q, starts = make_case(*case)
    k, v = (np.asarray(jnp.asarray(x, cache_dtype)) for x in (k, v))
    want = expected(q, k.astype(np.float32), v.astype(np.float32), tables, seq_lens, starts, head_dim, **variant)
    query_seq = np.repeat(np.arange(len(seq_lens)), q_lens)
    context_lens = np.concatenate([np.arange(n - m, n) + 1 for n, m in zip(seq_lens, q_lens)]).astype(int)
    padding = [i for i, n in enumerate(seq_lens) if n == 0]
    q = np.concatenate([q, np.ones((len(padding), *q.shape[1:]), np.float32)])
    want = np.concatenate([want, np.zeros((len(padding), *want.shape[1:]), np.float32)])
    query_seq, context_lens = np.concatenate([query_seq, padding]), np.concatenate([context_lens, [0] * len(padding)])
    return q, want, k, v, tables, query_seq, context_lens


@FEW
@given(paged_batches(decode_only=False), st.sampled_from(CACHE_DTYPES), variants())
def test_kernel_matches_the_reference(case, cache_dtype, variant: Variant):
    """Decode rows and prefill chunks (causal within the chunk, after a cached context) together, with and
    without a sliding window, ALiBi and a soft cap."""
    options = variant.kwargs(case[2] * case[3])
    q, want, k, v, tables, query_seq, context_lens = kernel_case(case, cache_dtype, **options)
    out = run_kernel(q, k, v, tables, query_seq, context_lens, case[0], **options)
    diff = np.abs(out - want).max()
    assert diff < 2e-5, f"max difference {diff}"  # float32 sums in another order (and padding rows exactly 0)


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("head_dim, group", [(48, 3), (64, 9), (64, 17)])
def test_the_loops_for_other_shapes(cache_dtype, head_dim, group):
    """Head dims other than 64, 80, 96, 128 and 256 take the kernel's loop with a run-time head dim; up to 16 query
    heads per KV head score their keys a vector (8 or 16) at a time (9: past the 8 that fit before), more one at a
    time."""
    case = (16, head_dim, group, 2, [40, 1, 0, 37], [1, 1, 0, 5], 7)  # decode rows and a prefill chunk
    q, want, k, v, tables, query_seq, context_lens = kernel_case(case, cache_dtype)
    out = run_kernel(q, k, v, tables, query_seq, context_lens, case[0])
    assert np.abs(out - want).max() < 2e-5


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("head_dim, group, num_kv_heads", [(256, 4, 1), (64, 3, 3)])  # Gemma 3, SmolLM2
def test_a_rows_output_does_not_depend_on_the_other_rows(cache_dtype, head_dim, group, num_kv_heads):
    """The kernel shares a step's work out by whole rows when there are many, by KV head when few, and splits a KV
    head's query heads among the threads when there are fewer groups than threads (one row of Gemma 3, one KV
    head): each row's output is the same to the bit either way, so batching never changes a greedy token."""
    case = (16, head_dim, group, num_kv_heads, [70 + 3 * i for i in range(64)], [1] * 64, 3)
    q, want, k, v, tables, query_seq, context_lens = kernel_case(case, cache_dtype)
    together = run_kernel(q, k, v, tables, query_seq, context_lens, 16)
    assert np.abs(together - want).max() < 2e-5
    for row in (0, 37):
        alone = run_kernel(q[row:row + 1], k, v, tables, query_seq[row:row + 1], context_lens[row:row + 1], 16)
        np.testing.assert_array_equal(alone[0], together[row])


@pytest.mark.parametrize("cache_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("head_dim", [64, 48])  # the vector loads and the scalar loop
def test_every_8_bit_value_widens_exactly(cache_dtype, head_dim):
    """A query with one key of context outputs that key's value: each of the 256 bit patterns, widened by the
    kernel, equals ml_dtypes' float32 (subnormals and signs included; NaN and infinity are never written)."""
    patterns = np.arange(256, dtype=np.uint8).view(cache_dtype)
    finite = patterns[np.isfinite(patterns.astype(np.float32))]
    rows = -(-finite.size // head_dim)
    values = np.resize(finite, rows * head_dim).reshape(rows, 1, 1, 1, head_dim)  # [L=rows, NB, bs, K, D]
    keys = np.zeros_like(values)
    out = np.concatenate([run_kernel(np.ones((1, 1, head_dim), np.float32), keys, values, np.zeros((1, 1), np.int32),
                                     [0], [1], 1, layer=layer) for layer in range(rows)])
    np.testing.assert_array_equal(out.reshape(-1), values.reshape(-1).astype(np.float32))


def test_window_reads_only_the_blocks_it_reaches():
    """Blocks wholly before every row's window may hold anything, even a block id outside the cache (a
    block freed later): they are neither checked nor read. A window reaching them is refused."""
    case = (16, 64, 3, 1, [60, 40], [3, 1], 5)  # rows at positions 57..59 and 39
    options = dict(sliding_window=10, alibi_slopes=np.array([0.5, 0.25, 0.125], np.float32))
    q, want, k, v, tables, query_seq, context_lens = kernel_case(case, **options)
    tables[0, :3], tables[1, :1] = 99, -1  # keys 0..47 of sequence 0 and 0..15 of sequence 1 are out of reach
    out = run_kernel(q, k, v, tables, query_seq, context_lens, 16, **options)
    assert np.abs(out - want).max() < 2e-5
    # The same program as above (the window is an operand): JAX reports the kernel's error as a ValueError when
    # it runs an already compiled program, as a JaxRuntimeError when it ran at the first call.
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="block id 99 out of range"):
        run_kernel(q, k, v, tables, query_seq, context_lens, 16, **{**options, "sliding_window": 20})


def test_loading_the_kernel_leaves_denormals_alone():
    """A library linked with -ffast-math would switch on flush-to-zero for the whole process when loaded."""
    assert cpu.kernel_unavailable_reason() is None
    smallest = np.float64(5e-324)
    assert smallest * np.float64(1.0) == smallest  # zero if denormals were flushed


def test_kernel_reads_the_layer_it_is_given():
    case = (16, 64, 3, 3, [40, 1, 0, 17], [5, 1, 0, 1], 7)
    q, want, k, v, tables, query_seq, context_lens = kernel_case(case)
    swapped = run_kernel(q, k[::-1], v[::-1], tables, query_seq, context_lens, 16, layer=0)  # layer 1 at index 0
    assert np.abs(swapped - want).max() < 2e-5
    assert np.abs(run_kernel(q, k, v, tables, query_seq, context_lens, 16, layer=0) - want).max() > 1e-2


@pytest.mark.parametrize("tables, query_seq, context_lens, message", [
    ([[0, 99]], [0, 0], [20, 3], "block id 99 out of range"),
    ([[0, -1]], [0, 0], [3, 20], "block id -1 out of range"),
    ([[0, 1]], [0, 0], [1, 33], "context_len 33 beyond its table"),
    ([[0, 1]], [0, 1], [1, 2], "query_seq 1 out of range"),
    ([[0, 1]], [0, 0], [1, -1], "context_len -1"),
])
def test_bad_inputs_are_errors_not_wild_reads(tables, query_seq, context_lens, message):
    k = np.zeros((2, 4, 16, 1, 64), np.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        run_kernel(np.zeros((2, 1, 64), np.float32), k, k, np.array(tables, np.int32), query_seq, context_lens, 16)


def test_bad_window_slopes_and_cap_are_errors():
    q, k, tables = np.zeros((1, 2, 64), np.float32), np.zeros((2, 4, 16, 1, 64), np.float32), np.zeros((1, 1), np.int32)
    with pytest.raises(ValueError, match="sliding_window must be at least 1"):
        run_kernel(q, k, k, tables, [0], [1], 16, sliding_window=0)
    with pytest.raises(jax.errors.JaxRuntimeError, match="inconsistent shapes"):
        run_kernel(q, k, k, tables, [0], [1], 16, alibi_slopes=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="logits_soft_cap must be positive"):
        run_kernel(q, k, k, tables, [0], [1], 16, logits_soft_cap=0.0)


def test_auto_backend_on_cpu_is_the_kernel_backend():
    backend = get_attention_backend("auto", "cpu")
    assert (backend.name, backend.attend, backend.ragged) == ("cpu", cpu.paged_attention, True)
    with pytest.raises(ValueError, match="attention_backend 'cpu' is unavailable: it runs on CPU, not 'gpu'"):
        get_attention_backend("cpu", "gpu")


def test_without_a_compiler_auto_falls_back_to_xla(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("JAX_ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    reason = cpu.kernel_unavailable_reason.__wrapped__()
    assert reason.startswith("RuntimeError: false -O3") and "failed" in reason
    monkeypatch.setattr(cpu, "kernel_unavailable_reason", lambda: reason)
    assert get_attention_backend("auto", "cpu").name == "xla"
    assert "CPU paged-attention kernel unavailable, using the xla backend" in caplog.text
    with pytest.raises(ValueError, match="attention_backend 'cpu' is unavailable: RuntimeError: false -O3"):
        get_attention_backend("cpu", "cpu")


@pytest.mark.parametrize("dtype", CACHE_DTYPES[1:])
def test_the_write_kernel_stores_what_xla_stores(dtype):
    """A 16- or 8-bit cache written by the write_kv kernel holds the bits XLA's convert and scatter give (to
    nearest, ties to even; overflow, infinities, tiny values), at the real tokens' slots of the given layer only."""
    rng = np.random.default_rng(0)
    layers, num_slots, kv_heads, head_dim = 3, 64, 2, 8
    scales = np.float32(10.0) ** rng.integers(-9, 7, (2, 6, kv_heads, head_dim))  # past float16's range both ways
    k, v = rng.standard_normal((2, 6, kv_heads, head_dim)).astype(np.float32) * scales
    k[0, 0, :4] = [np.inf, -np.inf, np.nan, 65520.0]  # 65520 rounds up to float16's infinity
    slots = jnp.array([5, 17, num_slots, 0, 63, num_slots], jnp.int32)  # num_slots: padding, dropped
    caches = [jnp.asarray(rng.standard_normal((layers, num_slots, kv_heads, head_dim)), dtype) for _ in range(2)]
    want = jax.jit(xla.write_kv)(jnp.asarray(k), jnp.asarray(v), *caches, jnp.int32(1), slots)
    got = jax.jit(cpu.write_kv)(jnp.asarray(k), jnp.asarray(v), *caches, jnp.int32(1), slots)
    bits = lambda x: np.asarray(x).view(f"u{jnp.dtype(dtype).itemsize}")  # noqa: E731
    for ours, theirs, before in zip(got, want, caches):
        assert ours.dtype == dtype
        ours, theirs = np.asarray(ours), np.asarray(theirs)
        assert not np.array_equal(bits(ours), bits(before))
        nan = np.isnan(theirs.astype(np.float32))
        assert np.array_equal(nan, np.isnan(ours.astype(np.float32)))
        assert np.array_equal(bits(ours)[~nan], bits(theirs)[~nan])
