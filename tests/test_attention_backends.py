"""Each attention backend's contract function (jax_engine/attention/metadata.py) against the NumPy reference,
on the layout the model runner gives it: a step of decode tokens and prefill chunks together, with and
without a sliding window and ALiBi. (The kernels alone: test_cpu_kernel.py, test_pallas_kernels.py.)"""

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings

from jax_engine.attention import cpu, pallas, xla
from jax_engine.attention.metadata import AttentionMetadata
from jax_engine.runner.padded_layout import padded_kind_rows, padded_table_rows
from tests.kernel_cases import COMPILED, Variant, expected, float32_tolerance, make_case, paged_batches, variants

PADDING_TOKENS = 2  # the runner buckets a step's tokens: rows past the last sequence's belong to no one
# Decode rows, a padding sequence and prefill chunks, then decode rows alone (the Pallas backend's other kernel),
# with a window cutting every context, ALiBi and a soft cap: whatever else Hypothesis draws in its few examples,
# these run.
MIXED = dict(case=(16, 64, 4, 2, [40, 1, 0, 37, 20], [1, 1, 0, 17, 20], 3), variant=Variant(10, 7, 1.5))
DECODE = dict(case=(16, 64, 4, 2, [40, 1, 0, 37], [1, 1, 0, 1], 5),  # Pallas: the decode kernel
              variant=Variant(10, 7, 1.5))


@dataclass
class Step:
    """One step's backend inputs, the rows of its real tokens, and the reference's output for those rows."""

    q: np.ndarray  # [T, N, D]
    k: np.ndarray  # [T, K, D]
    v: np.ndarray
    k_cache: np.ndarray  # [2, num_slots, K, D]; the backends attend in layer 1
    v_cache: np.ndarray
    metadata: AttentionMetadata
    real_rows: np.ndarray
    want: np.ndarray  # [len(real_rows), N, D]


def _layout(seq_lens: list[int], q_lens: list[int], ragged: bool) -> tuple[list[int], list[int], int]:
    """(the case's sequences in the runner's order, decode then prefill; the block-table row of each; the rows
    in all), laid out by the runner's own functions. The case's padding sequences (no tokens) are left to the
    runner's padding rows: between the kinds on the padded layout, after the sequences on the ragged one."""
    decode = [i for i, n in enumerate(seq_lens) if n and q_lens[i] == 1]
    prefill = [i for i, n in enumerate(seq_lens) if n and q_lens[i] > 1]
    if ragged:
        count = len(decode) + len(prefill)
        return decode + prefill, list(range(count)), len(seq_lens)
    return decode + prefill, *padded_table_rows(len(decode), len(prefill))


def make_step(case, options: dict, ragged: bool) -> Step:
    """Lay a kernel case out as the runner would for a ragged or a padded backend. The step's K/V are the ones
    the case's cache holds at their slots, so writing them changes nothing."""
    block_size, head_dim, group, num_kv_heads, seq_lens, q_lens, seed = case
    k_blocks, v_blocks, tables, q_case, starts = make_case(*case)
    order, table_rows, num_rows = _layout(seq_lens, q_lens, ragged)
    lens = [q_lens[i] for i in order]
    none = [np.zeros(0, int)]  # a case of padding sequences alone has no tokens
    case_rows = np.concatenate(none + [np.arange(starts[i], starts[i + 1]) for i in order]).astype(int)
    positions = np.concatenate(none + [np.arange(seq_lens[i] - q_lens[i], seq_lens[i]) for i in order]).astype(int)
    token_blocks = np.concatenate([tables[:0]] + [np.repeat(tables[i : i + 1], q_lens[i], axis=0) for i in order])
    slots = token_blocks[np.arange(len(positions)), positions // block_size] * block_size + positions % block_size
    k_cache, v_cache = (x.reshape(2, -1, num_kv_heads, head_dim) for x in (k_blocks, v_blocks))
    num_tokens = len(case_rows) + PADDING_TOKENS
    step_tables = np.zeros((num_rows, tables.shape[1]), np.int32)
    step_seq_lens, row_q_lens = np.zeros(num_rows, np.int32), np.zeros(num_rows, np.int32)
    for i, row in zip(order, table_rows):
        step_tables[row], step_seq_lens[row], row_q_lens[row] = tables[i], seq_lens[i], q_lens[i]
    query_start_loc = np.concatenate([[0], np.cumsum(row_q_lens)]).astype(np.int32)
    first_rows = np.concatenate([[0], np.cumsum(lens)])  # each sequence's first token row, in order
    num_decode = sum(n == 1 for n in lens)
    if ragged:
        decode_rows, prefill_rows, max_query_len = np.zeros(0, np.int32), np.zeros((0, 0), np.int32), 0
    else:
        decode_rows, prefill_rows = padded_kind_rows(list(first_rows[:num_decode]),
                                                     list(zip(first_rows[num_decode:-1], lens[num_decode:])),
                                                     num_tokens)
        max_query_len = max(prefill_rows.shape[1], 1)

    def pad(x: np.ndarray, value) -> np.ndarray:
        return np.concatenate([x, np.full((PADDING_TOKENS, *x.shape[1:]), value, x.dtype)])

    metadata = AttentionMetadata(
        jnp.array(pad(positions, 0), jnp.int32), jnp.array(pad(slots, k_cache.shape[1]), jnp.int32),  # pad: dropped
        jnp.array(step_tables), jnp.array(step_seq_lens), jnp.array(query_start_loc), jnp.array(decode_rows),
        jnp.array(prefill_rows), max_query_len)
    want = expected(q_case, k_blocks, v_blocks, tables, seq_lens, starts, head_dim, **options)[case_rows]
    return Step(pad(q_case[case_rows], 0.0), pad(k_cache[1, slots], 0.0), pad(v_cache[1, slots], 0.0), k_cache,
                v_cache, metadata, np.arange(len(case_rows)), want)


def check_backend(attention, case, variant: Variant, ragged: bool, compiled: bool = COMPILED) -> None:
    """Run a contract function jitted (as the model does) and compare the real tokens' rows with the reference
    (compiled: on a GPU, where float32 dots round to TF32)."""
    options = variant.kwargs(case[2] * case[3])
    step = make_step(case, options, ragged)
    head_dim = step.q.shape[-1]
    run = jax.jit(attention, static_argnames=("block_size", "scale", "sliding_window", "logits_soft_cap"))
    out, k_cache, v_cache = run(jnp.array(step.q), jnp.array(step.k), jnp.array(step.v), jnp.array(step.k_cache),
                                jnp.array(step.v_cache), jnp.int32(1), step.metadata, block_size=case[0],
                                scale=head_dim**-0.5, **options)
    assert all(np.array_equal(np.asarray(new), old, equal_nan=True)  # the step's keys and values were there
               for new, old in ((k_cache, step.k_cache), (v_cache, step.v_cache)))
    # Only real tokens' rows: padding tokens' rows are garbage (the Pallas interpreter leaves them NaN).
    diff = np.abs(np.asarray(out)[step.real_rows] - step.want).max(initial=0)
    # float32, summed in another order than the reference (and, compiled on a GPU, dots in TF32)
    assert diff < float32_tolerance(step.v_cache, max(case[4]), compiled), f"max difference {diff}"


@settings(max_examples=max(settings.default.max_examples // 12, 4))  # each new shape compiles the step (~0.6 s)
@given(paged_batches(decode_only=False), variants())
@example(**MIXED)
@example(**DECODE)
def test_xla_backend_matches_the_reference(case, variant: Variant):
    check_backend(xla.paged_attention, case, variant, ragged=False)


@pytest.mark.skipif(cpu.kernel_unavailable_reason() is not None, reason="no CPU kernel")
@settings(max_examples=max(settings.default.max_examples // 8, 4))
@given(paged_batches(decode_only=False), variants())
@example(**MIXED)
@example(**DECODE)
def test_cpu_backend_matches_the_reference(case, variant: Variant):
    with jax.default_device(jax.devices("cpu")[0]):  # a host kernel: on a GPU machine too it runs on the CPU
        check_backend(cpu.paged_attention, case, variant, ragged=True, compiled=False)


@settings(max_examples=1)  # the interpreter is slow; this checks the wiring, test_pallas_kernels.py the kernels
@given(paged_batches(decode_only=False), variants())
@example(**MIXED)
@example(**DECODE)
def test_pallas_backend_matches_the_reference(case, variant: Variant):
    interpret = jax.default_backend() != "gpu"
    check_backend(functools.partial(pallas.paged_attention, interpret=interpret), case, variant, ragged=False)
