"""The start-up self-test of the Pallas attention kernels (issue 42): before serving, run them once against the
xla path on a small random step of the model's real shapes, and serve on xla (or stop) if they disagree.

Why: on a GPU the kernels are compiled by Triton for the card, driver and model at hand, and a miscompile or a
shape the kernel tests never drew (a head count, head dim, window or set of ALiBi slopes) would otherwise show
only as wrong text. Two small steps, compiled once at start-up, check them where they will run.

The step is laid out as the model runner lays out a padded backend's step (its own padded_table_rows and
padded_kind_rows; it lives beside the runner because attention/ may not import runner/): decode rows and
prefill chunks together, which the Pallas backend runs with its ragged kernel, then decode rows alone, which
it runs with its decode kernel. The contexts cross block boundaries and, when the window is shorter than
max_model_len, the sliding window. The keys and values written this step replace random cache contents, so
the K/V write is checked too, in layer 1 of a two-layer cache (a layer mix-up shows).
"""

import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.attention import AttentionBackend, get_attention_backend
from jax_engine.attention.metadata import AttentionFn, AttentionMetadata
from jax_engine.attention.xla import paged_attention as xla_attention
from jax_engine.buckets import bucket_fine, bucket_tokens
from jax_engine.model_config import ModelConfig
from jax_engine.runner.padded_layout import padded_kind_rows, padded_table_rows
from reference.block_manager import cdiv

logger = logging.getLogger(__name__)

LAYER = 1  # of a two-layer cache
SEED = 0  # the same case at every start: a failure reproduces


class AttentionSelfTestError(RuntimeError):
    """The kernels disagreed with the xla path and attention_self_test="error" asked to stop."""


@dataclass(frozen=True)
class AttentionShapes:
    """What of the model and its KV cache the self-test copies."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    alibi_slopes: tuple[float, ...] | None
    dtype: object  # the KV cache's (and activations') dtype
    block_size: int
    max_model_len: int
    logits_soft_cap: float | None = None

    @classmethod
    def of(cls, cfg: ModelConfig, dtype, block_size: int, max_model_len: int) -> "AttentionShapes":
        return cls(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_scale, cfg.sliding_window,
                   cfg.alibi_slopes, dtype, block_size, max_model_len, cfg.attn_logit_softcapping)


def tolerance(dtype, compiled: bool, keys: int) -> float:
    """The largest difference rounding alone can explain on the case (outputs within [-1, 1], contexts of up to
    `keys` tokens); a kernel that differs by more computes something else.

    Every output is a convex combination of value rows drawn in [-1, 1), so a difference here is one relative to
    the outputs' scale. The reference is exact to float32 (xla in float32 at the highest matmul precision, on the
    same rounded inputs); what is left:
    - storing the output in the cache dtype: at most half its epsilon (u = 2**-8 bfloat16, 2**-11 float16,
      2**-24 float32), 4 u allowed;
    - the kernels' dots, taken in float32: compiled, Triton rounds a float32 dot's inputs to TF32 (u = 2**-11),
      interpreted they are IEEE (u = 2**-24). Rounding q and k moves a logit by about u RMS (scale is
      head_dim**-0.5 and q, k have unit variance), some 4 u at the largest of the case's ~10^5 logits; a logit
      error d moves an output by at most 2 d, and rounding the weights and values adds 2 u: ~10 u, 32 u allowed;
    - both sides' float32 sums over up to `keys` keys (the weights' and the weighted values'): each off by at
      most keys * 2**-24 (the bound of a recursive sum whose terms' magnitudes add up to at most 1).
    Interpreted float32: 1.5e-5 with 53-token contexts (7e-7 seen at 547); bfloat16 1.6e-2 (2e-3 seen).
    Compiled float32: 1.7e-2. A scale or slopes 10% off move outputs by 0.05 or more, a window one token off or
    ALiBi left out by 0.5 or more (tests/test_attention_self_test.py).
    """
    output = float(jnp.finfo(dtype).eps) / 2
    dots = 2.0**-11 if compiled else 2.0**-24
    return 4 * output + 32 * dots + 4 * keys * 2.0**-24


def _steps(shapes: AttentionShapes) -> dict[str, list[tuple[int, int]]]:
    """Each step's sequences as (context length with this step's tokens, new tokens), decode rows first.

    A long context crosses the window by two blocks and more (or runs three blocks without a window, or with one
    no context can reach); a context of one token and one that ends on a block boundary; a later prefill chunk
    over a cached prefix that crosses a block boundary, and a whole short prompt."""
    bs, window, limit = shapes.block_size, shapes.sliding_window, shapes.max_model_len
    cuts = window is not None and window < limit
    long = min(window + 2 * bs + 3 if cuts else 3 * bs + 5, limit)
    steps = {
        "decode and prefill (ragged kernel)": [(long, 1), (1, 1), (min(bs, limit), 1),
                                               (long, min(bs + 3, long)), (min(7, limit), min(7, limit))],
        "decode only (decode kernel)": [(long, 1), (min(bs + 1, limit), 1), (min(2, limit), 1)],
    }
    # A max_model_len of a token or two makes chunks single tokens: decode rows, which go first.
    return {name: sorted(seqs, key=lambda seq: seq[1] > 1) for name, seqs in steps.items()}


@dataclass(frozen=True)
class _Step:
    arrays: tuple[np.ndarray, ...]  # q [T, N, D], k, v [T, K, D], k_cache, v_cache [2, S, K, D]: float32
    metadata: AttentionMetadata
    real_rows: np.ndarray  # the rows of the step's tokens (the rest pads the token bucket)


def _block_tables(seqs: list[tuple[int, int]], block_size: int,
                  rng: np.random.Generator) -> tuple[list[np.ndarray], int]:
    """(each sequence's block ids, scattered over the cache; the cache's blocks in all)."""
    counts = [cdiv(context, block_size) for context, _ in seqs]
    ids = rng.permutation(sum(counts) + 1)  # one block more: padding rows' tables point at block 0
    return np.split(ids[: sum(counts)], np.cumsum(counts)[:-1]), sum(counts) + 1


def _metadata(seqs: list[tuple[int, int]], tables: list[np.ndarray], shapes: AttentionShapes,
              num_slots: int) -> tuple[AttentionMetadata, int]:
    """The padded layout of the step, as ModelRunner.prepare lays it out, and its token rows in all."""
    bs, num_decode = shapes.block_size, sum(n == 1 for _, n in seqs)
    table_rows, num_rows = padded_table_rows(num_decode, len(seqs) - num_decode)
    num_tokens = bucket_tokens(sum(n for _, n in seqs))
    columns = min(bucket_fine(max(len(t) for t in tables), 8), cdiv(shapes.max_model_len, bs))
    positions, slots = np.zeros(num_tokens, np.int32), np.full(num_tokens, num_slots, np.int32)
    block_tables = np.zeros((num_rows, columns), np.int32)
    seq_lens, q_lens = np.zeros(num_rows, np.int32), np.zeros(num_rows, np.int32)
    firsts = np.concatenate([[0], np.cumsum([n for _, n in seqs])])
    for (context, n), table, row, first in zip(seqs, tables, table_rows, firsts):
        pos = np.arange(context - n, context)
        positions[first : first + n], slots[first : first + n] = pos, table[pos // bs] * bs + pos % bs
        block_tables[row, : len(table)], seq_lens[row], q_lens[row] = table, context, n
    decode_rows, prefill_rows = padded_kind_rows(list(firsts[:num_decode]),
                                                 [(firsts[i], n) for i, (_, n) in enumerate(seqs) if n > 1],
                                                 num_tokens)
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    metadata = AttentionMetadata(*(jnp.asarray(x, jnp.int32) for x in (positions, slots, block_tables, seq_lens,
                                                                        starts, decode_rows, prefill_rows)),
                                 max_query_len=max(prefill_rows.shape[1], 1))
    return metadata, num_tokens


def _make_step(seqs: list[tuple[int, int]], shapes: AttentionShapes, rng: np.random.Generator) -> _Step:
    """Random queries and keys (unit normal), values in [-1, 1) (so outputs are too), the cache full of others;
    every array rounded to the cache dtype, so both sides read the same numbers."""
    tables, num_blocks = _block_tables(seqs, shapes.block_size, rng)
    metadata, num_tokens = _metadata(seqs, tables, shapes, num_blocks * shapes.block_size)
    real = sum(n for _, n in seqs)
    heads, kv = (shapes.num_heads, shapes.head_dim), (shapes.num_kv_heads, shapes.head_dim)
    cache = (2, num_blocks * shapes.block_size, *kv)
    q, k = rng.standard_normal((real, *heads)), rng.standard_normal((real, *kv))
    v = rng.uniform(-1, 1, (real, *kv))
    q, k, v = (np.pad(x, [(0, num_tokens - real), (0, 0), (0, 0)]) for x in (q, k, v))
    arrays = (q, k, v, rng.standard_normal(cache), rng.uniform(-1, 1, cache))
    rounded = tuple(np.asarray(jnp.asarray(x, shapes.dtype).astype(jnp.float32)) for x in arrays)
    return _Step(rounded, metadata, np.arange(real))


def _attend(attend: AttentionFn, step: _Step, shapes: AttentionShapes, dtype) -> np.ndarray:
    """`attend`'s output on the step's real rows, its inputs in `dtype`, jitted as the model runs it."""
    slopes = None if shapes.alibi_slopes is None else jnp.asarray(shapes.alibi_slopes, jnp.float32)

    def run(q, k, v, k_cache, v_cache, metadata):
        return attend(q, k, v, k_cache, v_cache, jnp.int32(LAYER), metadata, shapes.block_size, shapes.scale,
                      sliding_window=shapes.sliding_window, alibi_slopes=slopes,
                      logits_soft_cap=shapes.logits_soft_cap)[0]

    out = jax.jit(run)(*(jnp.asarray(x, dtype) for x in step.arrays), step.metadata)
    return np.asarray(out[step.real_rows].astype(jnp.float32))


@dataclass(frozen=True)
class SelfTestResult:
    """The largest difference on the real tokens' rows of each step, and the tolerance they are held to."""

    differences: dict[str, float]  # step -> max |candidate - xla|; NaN when either gave a NaN (that fails)
    tolerance: float

    @property
    def max_difference(self) -> float:
        return float(np.max(list(self.differences.values())))  # np.max, not max: a NaN must win

    @property
    def passed(self) -> bool:
        return bool(self.max_difference <= self.tolerance)


def compare(candidate: AttentionFn, shapes: AttentionShapes, compiled: bool) -> SelfTestResult:
    """Run `candidate` (an attention function of the padded layout, in shapes.dtype) and the xla path (float32,
    highest matmul precision) on the same two steps; hold the difference to `tolerance` (compiled: not in the
    Pallas interpreter)."""
    rng, steps = np.random.default_rng(SEED), _steps(shapes)
    differences = {}
    for name, seqs in steps.items():
        step = _make_step(seqs, shapes, rng)
        ours = _attend(candidate, step, shapes, shapes.dtype)
        with jax.default_matmul_precision("highest"):
            want = _attend(xla_attention, step, shapes, jnp.float32)
        differences[name] = float(np.max(np.abs(ours - want), initial=0.0))
    keys = max(context for seqs in steps.values() for context, _ in seqs)
    return SelfTestResult(differences, tolerance(shapes.dtype, compiled, keys))


def checked_backend(mode: str, backend: AttentionBackend, shapes: AttentionShapes,
                    platform: str) -> AttentionBackend:
    """The backend to serve on: `backend`, or xla when the self-test ran and failed with mode "auto" or
    "fallback" (see EngineArgs.attention_self_test). Raises AttentionSelfTestError on a failure with "error".

    Only the Pallas backend is tested ("auto": only compiled, on a GPU); xla is the reference, and the cpu
    kernel is checked by its own tests on the machine kind it runs on.
    """
    if mode == "off" or backend.name != "pallas" or (mode == "auto" and platform != "gpu"):
        return backend
    result = compare(backend.attend, shapes, compiled=platform == "gpu")
    summary = ", ".join(f"{name}: {diff:.3g}" for name, diff in result.differences.items())
    if result.passed:
        logger.info("attention self-test passed: the pallas kernels match the xla path within %.3g (%s)",
                    result.tolerance, summary)
        return backend
    message = (f"attention self-test failed: the pallas kernels differ from the xla path by "
               f"{result.max_difference:.3g}, more than the tolerance {result.tolerance:.3g} for "
               f"{np.dtype(shapes.dtype).name} ({summary})")
    if mode == "error":
        raise AttentionSelfTestError(f"{message}; attention_self_test='fallback' serves on xla instead")
    logger.warning("%s; serving on the xla attention backend", message)
    return get_attention_backend("xla", platform)
