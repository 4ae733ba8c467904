"""Batched, jitted sampling: the token controls and penalties (processed_logits), then the draw (temperature,
top-k, top-p, min-p, per-request seeds), then logprobs. Its input is a SamplingBatch (sampling_batch.py).

Randomness: row r draws one uniform number from `fold_in(key(seed_r), position_r)` and inverts the
filtered distribution's CDF. A seeded request's token at a position therefore depends only on (seed,
position) and its logits, never on which other requests share the batch.
"""

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.sample.greedy_argmax import greedy_tokens
from jax_engine.sample.sampling_batch import STAGES, SamplingBatch
from jax_engine.sample.top_k_top_p import top_k_top_p_threshold
from jax_engine.sampling_params import MAX_LOGPROBS

_NEG_INF = -jnp.inf


@functools.partial(jax.tree_util.register_dataclass, meta_fields=(),
                   data_fields=("tokens", "logprobs", "ranks", "top_ids", "top_logprobs"))
@dataclass(frozen=True)
class SamplerOutput:
    """The sampled token of every row, with its logprob, its rank and the row's top logprobs."""

    tokens: jax.Array  # [R] int32
    logprobs: jax.Array  # [R] float32
    ranks: jax.Array  # [R] int32
    top_ids: jax.Array  # [R, n] int32
    top_logprobs: jax.Array  # [R, n] float32

    def rows(self, count: int) -> list["SampledToken"]:
        """The first `count` rows, copied to the host."""
        host = [to_host(x) for x in (self.tokens, self.logprobs, self.ranks, self.top_ids, self.top_logprobs)]
        return [SampledToken(int(host[0][i]), float(host[1][i]), int(host[2][i]), host[3][i], host[4][i])
                for i in range(count)]


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated result as a NumPy array: this process's copy (on several hosts the others hold theirs)."""
    return np.asarray(x.addressable_data(0))


@dataclass(frozen=True)
class SampledToken:
    """One row of a SamplerOutput, on the host."""

    token: int
    logprob: float
    rank: int
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclass(frozen=True)
class SampledRows:
    """A step's sampled rows, returned as soon as the sampler is dispatched: the device may still be computing
    them. `read()` waits for them and copies them to the host, so the engine can plan the next step first
    (async scheduling, jax_engine/async_scheduling.py)."""

    output: SamplerOutput | None  # None: no row sampled
    count: int

    def read(self) -> list[SampledToken]:
        return [] if self.output is None else self.output.rows(self.count)


def _apply_penalties(logits, penalty_ids, num_prompt_tokens, presence, frequency, repetition):
    """vLLM's penalties. penalty_ids holds each row's prompt, then its output, padded with vocab_size (dropped)."""
    rows, vocab = logits.shape
    row_index = jnp.arange(rows)[:, None]
    in_output = jnp.arange(penalty_ids.shape[1])[None, :] >= num_prompt_tokens[:, None]
    counts = jnp.zeros((rows, vocab), jnp.float32).at[row_index, penalty_ids].add(in_output.astype(jnp.float32),
                                                                                  mode="drop")
    in_prompt = jnp.zeros((rows, vocab), bool).at[row_index, penalty_ids].max(~in_output, mode="drop")
    seen = in_prompt | (counts > 0)
    r = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def _top_k_top_p_mask(logits, top_k, top_p):
    """Mask (to -inf) what top-k and top-p remove. top_k 0 keeps all; ties with the k-th value stay."""
    return jnp.where(logits >= top_k_top_p_threshold(logits, top_k, top_p)[:, None], logits, _NEG_INF)


_CDF_BLOCK = 256


def _last_positive(x: jax.Array) -> jax.Array:
    """Index of the last positive entry along the last axis."""
    return x.shape[-1] - 1 - jnp.argmax(x[..., ::-1] > 0, axis=-1)


def _draw(weights, seeds, positions):
    """Inverse-CDF sampling with one uniform per row from (seed, position).

    NOTE: a cumulative sum over the whole vocabulary is slow on CPU (20 ms for 64 x 49152), so the CDF is
    walked in two levels: first over blocks of 256 tokens, then inside the chosen block.
    """
    def uniform(seed, position):
        return jax.random.uniform(jax.random.fold_in(jax.random.key(seed), position))

    rows, vocab = weights.shape
    blocks = jnp.pad(weights, ((0, 0), (0, -vocab % _CDF_BLOCK))).reshape(rows, -1, _CDF_BLOCK)
    block_sums = blocks.sum(axis=-1)
    block_cdf = jnp.cumsum(block_sums, axis=-1)
    target = jax.vmap(uniform)(seeds, positions) * block_cdf[:, -1]
    # The first block whose cumulative mass exceeds the target (rounding aside, it has positive mass).
    block = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), _last_positive(block_sums))
    before = jnp.where(block > 0, jnp.take_along_axis(block_cdf, jnp.maximum(block - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [R, 256]
    offset = jnp.sum(jnp.cumsum(inner, axis=-1) <= (target - before)[:, None], axis=-1)
    token = block * _CDF_BLOCK + jnp.minimum(offset, _last_positive(inner))
    # A row without any weight (all zero, or NaN) would land on the last padding index past the vocabulary (511
    # for 258 tokens, seen in the full suite's test_request_limits): -1 says so, and _drawn takes the argmax.
    return jnp.where(block_cdf[:, -1] > 0, token, -1)


def _unpack_bitmask(bitmask: jax.Array, vocab: int) -> jax.Array:
    """[R, W] int32 words -> [R, V] bool: token t is bit t % 32 of word t // 32."""
    token = jnp.arange(vocab)
    return (jnp.right_shift(bitmask[:, token // 32], token % 32) & 1).astype(bool)



def _when(switch, stage, x):
    """stage(x) if the stage is on: decided when compiling (a Python bool), or per batch (a traced bool, where
    lax.cond runs one branch)."""
    if isinstance(switch, bool):
        return stage(x) if switch else x
    return jax.lax.cond(switch, stage, lambda x: x, x)


def _either(switch, if_on, if_off, *operands):
    if isinstance(switch, bool):
        return (if_on if switch else if_off)(*operands)
    return jax.lax.cond(switch, if_on, if_off, *operands)



def _on(batch: SamplingBatch, stage: str) -> bool | jax.Array:
    """Whether `stage` runs: fixed when compiled in a plain program (a Python bool), per batch in the general
    one (a traced bool)."""
    flags = batch.flags
    if flags.general:
        return batch.stages[STAGES.index(stage)]
    return {"random": not flags.all_greedy, "top_k_or_p": flags.top_k_or_p}.get(stage, False)


@functools.partial(jax.jit, donate_argnames=("scratch",))
def sample(logits, batch: SamplingBatch, scratch=None) -> tuple[SamplerOutput, jax.Array | None]:
    """Sample one token per row.

    Args:
        logits: [R, V] float32 next-token logits.
        batch: the rows' sampling settings (see SamplingBatch); its flags are static and pick the program.
        scratch: optional donated [R, V] float32 buffer that the sampling weights are written into instead
            of a fresh array (see recycled_buffers.py).

    Returns:
        (the sampled tokens with their logprobs, the scratch buffer to hand back, or None); logprobs are of
        the model's raw distribution, as vLLM reports them, with the top MAX_LOGPROBS of each row (the host
        keeps as many as each request asked for), and zeros unless some row asked for logprobs.
    """
    drawn = functools.partial(_drawn, batch=batch)
    tokens, spent = _either(_on(batch, "random"), drawn, lambda final, scratch: (greedy_tokens(final), scratch),
                            processed_logits(logits, batch), scratch)
    return SamplerOutput(tokens, *_logprobs(logits, tokens, batch)), spent


def processed_logits(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    """The logits after the token mask, the logit biases and the penalties, in that order: a grammar's mask
    comes before vLLM's sampler, then the token controls in vLLM's order (reference.sampler.processed_logits)."""
    rows, vocab = logits.shape
    masked = _when(_on(b, "token_mask"), lambda x: jnp.where(_unpack_bitmask(b.token_mask, vocab), x, _NEG_INF),
                   logits)
    biased = _when(_on(b, "logit_bias"),
                   lambda x: x.at[jnp.arange(rows)[:, None], b.bias_ids].add(b.bias_values, mode="drop"), masked)
    return _when(_on(b, "penalties"), lambda x: _apply_penalties(x, b.penalty_ids, b.num_prompt_tokens, b.presence,
                                                                 b.frequency, b.repetition), biased)


def _drawn(final: jax.Array, scratch: jax.Array | None, batch: SamplingBatch) -> tuple[jax.Array, jax.Array | None]:
    """Each row's token drawn from its processed logits after temperature, top-k/top-p and min-p (a greedy
    row's argmax), and the scratch buffer holding the weights."""
    b = batch
    scaled = final / jnp.where(b.temperature > 0, b.temperature, 1.0)[:, None]
    scaled = _when(_on(b, "top_k_or_p"), lambda s: _top_k_top_p_mask(s, b.top_k, b.top_p), scaled)
    # Unnormalised probabilities suffice: the draw compares against a fraction of their total.
    weights = jnp.exp(scaled - scaled.max(axis=-1, keepdims=True))
    # The max weight is exactly 1, so min_p compares with the weights themselves.
    weights = _when(_on(b, "min_p"), lambda w: jnp.where(w >= b.min_p[:, None], w, 0.0), weights)
    tokens = _draw(weights, b.seeds, b.positions).astype(jnp.int32)
    if scratch is not None:  # XLA then computes the weights straight into the scratch's memory
        scratch = jax.lax.dynamic_update_slice(scratch, weights, (0, 0))
    # Greedy rows beside random ones take the argmax. Always computed: a flag for "some rows are greedy"
    # would double the sampler programs, for a few ms at 256 rows. So does a row left without weight (which
    # request leads there is not pinned down yet; +inf scaled logits would, their NaN weights zeroed by min_p).
    return jnp.where((b.temperature > 0) & (tokens >= 0), tokens, greedy_tokens(final)), scratch


def _logprobs(logits: jax.Array, tokens: jax.Array, batch: SamplingBatch) -> tuple[jax.Array, ...]:
    """token_logprobs of the raw logits when some row asked for logprobs, else zeros of the same shapes."""
    rows, vocab = logits.shape

    def without_logprobs(tokens):
        top = min(MAX_LOGPROBS, vocab) if batch.flags.general else 0
        return (jnp.zeros(rows), jnp.zeros(rows, jnp.int32), jnp.zeros((rows, top), jnp.int32),
                jnp.zeros((rows, top)))

    return _either(_on(batch, "logprobs"), lambda tokens: token_logprobs(logits, tokens), without_logprobs, tokens)


def token_logprobs(logits, tokens):
    """(logprob of each row's token, its rank, the top MAX_LOGPROBS ids and their logprobs) under the model's raw
    distribution, as vLLM reports them."""
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    ranks = jnp.sum(raw_logprobs > chosen[:, None], axis=-1).astype(jnp.int32) + 1
    top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    return chosen, ranks, top_ids.astype(jnp.int32), top_logprobs
