"""Batched, jitted sampling: grammar bitmasks, token controls, penalties, temperature, top-k, top-p, min-p,
per-request seeds, logprobs.

Randomness: row r draws one uniform number from `fold_in(key(seed_r), position_r)` and inverts the
filtered distribution's CDF. A seeded request's token at a position therefore depends only on (seed,
position) and its logits, never on which other requests share the batch.
"""

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.buckets import bucket
from jax_engine.sampling_params import MAX_LOGPROBS
from jax_engine.structured_output.grammar import ALL_ALLOWED

_NEG_INF = -jnp.inf


@dataclass(frozen=True)
class SamplerFlags:
    """Which optional stages this batch needs (static: each combination compiles once)."""

    all_greedy: bool
    top_k_or_p: bool
    penalties: bool
    ban_tokens: bool
    min_p: bool = False
    logprobs: bool = False  # compute the sampled tokens' logprobs and ranks (only when someone asks)
    allowed_tokens: bool = False  # some row keeps only its allowed_token_ids
    logit_bias: bool = False
    structured: bool = False  # some row follows a grammar (its grammar_bitmask row)


@functools.partial(jax.tree_util.register_dataclass, meta_fields=("flags", "num_logprobs"),
                   data_fields=("temperature", "top_k", "top_p", "min_p", "seeds", "positions", "prompt_ids",
                                "output_ids", "presence", "frequency", "repetition", "banned_ids", "allowed_ids",
                                "bias_ids", "bias_values", "grammar_bitmask"))
@dataclass(frozen=True)
class SamplingBatch:
    """The sampler's input: one row per sequence (padded rows sample harmlessly and are dropped)."""

    temperature: np.ndarray  # [R] float32
    top_k: np.ndarray  # [R] int32, 0 = all
    top_p: np.ndarray  # [R] float32
    min_p: np.ndarray  # [R] float32
    seeds: np.ndarray  # [R] uint32: each sequence's resolved seed
    positions: np.ndarray  # [R] int32: the position being sampled (the draw depends on seed and position)
    prompt_ids: np.ndarray  # [R, P] int32 padded with V (penalties only, else [R, 1])
    output_ids: np.ndarray  # [R, O] int32 padded with V (penalties only, else [R, 1])
    presence: np.ndarray  # [R] float32
    frequency: np.ndarray  # [R] float32
    repetition: np.ndarray  # [R] float32
    banned_ids: np.ndarray  # [R, Bn] int32: stop tokens before min_tokens and bad words' next tokens, padded with V
    flags: SamplerFlags
    num_logprobs: int  # top logprobs to return per row (0 = none)
    allowed_ids: np.ndarray  # [R, A] int32 allowed_token_ids, padded with V (a row with none keeps all)
    bias_ids: np.ndarray  # [R, Bb] int32 logit_bias tokens, padded with V
    bias_values: np.ndarray  # [R, Bb] float32 their biases
    # [R, ceil(V / 32)] int32: bit t % 32 of word t // 32 allows token t (structured output; else [R, 1])
    grammar_bitmask: np.ndarray


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


def _apply_penalties(logits, prompt_ids, output_ids, presence, frequency, repetition):
    """vLLM's penalties. prompt_ids / output_ids are padded with vocab_size (dropped)."""
    rows, vocab = logits.shape
    row_index = jnp.arange(rows)[:, None]
    counts = jnp.zeros((rows, vocab), jnp.float32).at[row_index, output_ids].add(1.0, mode="drop")
    in_prompt = jnp.zeros((rows, vocab), bool).at[row_index, prompt_ids].set(True, mode="drop")
    seen = in_prompt | (counts > 0)
    r = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def _top_k_top_p_mask(logits, top_k, top_p):
    """Mask (to -inf) what top-k and top-p remove. top_k 0 keeps all; ties with the k-th value stay."""
    vocab = logits.shape[-1]
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    ordered = jnp.where(ordered >= kth, ordered, _NEG_INF)
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # of strictly more likely tokens
    # The most likely token always stays, even for a top_p that float32 rounds to 0.
    keep = (mass_before < top_p[:, None]) | (jnp.arange(vocab) == 0)
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= jnp.maximum(threshold, kth), logits, _NEG_INF)


_CDF_BLOCK = 256


def _last_positive(x: jax.Array) -> jax.Array:
    """Index of the last positive entry along the last axis."""
    return x.shape[-1] - 1 - jnp.argmax(x[..., ::-1] > 0, axis=-1)


def _greedy(logits: jax.Array) -> jax.Array:
    """The highest logit's token per row (the first of equal ones, as argmax).

    NOTE: XLA:CPU's argmax (a reduce over (value, index) pairs) is slow: 49152 logits take 0.26 ms at 1 row and
    28 ms at 256 rows on 2 cores, where top_k(1) takes 0.08 and 18 ms and returns the same token.
    """
    return jax.lax.top_k(logits, 1)[1][:, 0].astype(jnp.int32)


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
    return block * _CDF_BLOCK + jnp.minimum(offset, _last_positive(inner))


def _unpack_bitmask(bitmask: jax.Array, vocab: int) -> jax.Array:
    """[R, W] int32 words -> [R, V] bool: token t is bit t % 32 of word t // 32."""
    token = jnp.arange(vocab)
    return (jnp.right_shift(bitmask[:, token // 32], token % 32) & 1).astype(bool)


@functools.partial(jax.jit, donate_argnames=("scratch",))
def sample(logits, batch: SamplingBatch, scratch=None) -> tuple[SamplerOutput, jax.Array | None]:
    """Sample one token per row.

    Args:
        logits: [R, V] float32 next-token logits.
        batch: the rows' sampling settings (see SamplingBatch); its flags and num_logprobs are static, so
            each combination compiles once.
        scratch: optional donated [R, V] float32 buffer that the sampling weights are written into instead
            of a fresh array (see model_runner.RecycledBuffers).

    Returns:
        (the sampled tokens with their logprobs, the scratch buffer to hand back, or None); logprobs are of
        the model's raw distribution, as vLLM reports them, and zeros unless flags.logprobs.
    """
    b, flags = batch, batch.flags
    temperature, top_k, top_p, min_p, seeds, positions = (b.temperature, b.top_k, b.top_p, b.min_p, b.seeds,
                                                          b.positions)
    raw_logits, spent = logits, scratch
    rows = logits.shape[0]
    row_index = jnp.arange(rows)[:, None]
    # A grammar's mask first (vLLM applies it to the logits before its sampler), then the token controls in
    # vLLM's order (reference.sampler.processed_logits), then the penalties.
    if flags.structured:
        logits = grammar_logits = jnp.where(_unpack_bitmask(b.grammar_bitmask, logits.shape[1]), logits, _NEG_INF)
    if flags.allowed_tokens:
        vocab = logits.shape[1]
        allowed = jnp.zeros(logits.shape, bool).at[row_index, b.allowed_ids].set(True, mode="drop")
        restricted = jnp.any(b.allowed_ids < vocab, axis=-1, keepdims=True)
        logits = jnp.where(allowed | ~restricted, logits, _NEG_INF)
    if flags.ban_tokens:
        logits = logits.at[row_index, b.banned_ids].set(_NEG_INF, mode="drop")
    if flags.logit_bias:
        logits = logits.at[row_index, b.bias_ids].add(b.bias_values, mode="drop")
    if flags.structured:
        # Controls that leave a constrained row no token at all (min_tokens banning the EOS that is all a finished
        # grammar allows; allowed_token_ids outside the grammar) give way to the grammar: its output stays valid.
        nothing_left = jnp.all(logits == _NEG_INF, axis=-1, keepdims=True)
        logits = jnp.where(nothing_left, grammar_logits, logits)
    if flags.penalties:
        logits = _apply_penalties(logits, b.prompt_ids, b.output_ids, b.presence, b.frequency, b.repetition)
    if flags.all_greedy:
        tokens = _greedy(logits)
    else:
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        if flags.top_k_or_p:
            scaled = _top_k_top_p_mask(scaled, top_k, top_p)
        # Unnormalised probabilities suffice: the draw compares against a fraction of their total.
        weights = jnp.exp(scaled - scaled.max(axis=-1, keepdims=True))
        if flags.min_p:
            weights = jnp.where(weights >= min_p[:, None], weights, 0.0)  # the max weight is exactly 1
        tokens = _draw(weights, seeds, positions).astype(jnp.int32)
        if scratch is not None:  # XLA then computes the weights straight into the scratch's memory
            spent = jax.lax.dynamic_update_slice(scratch, weights, (0, 0))
        # Greedy rows beside random ones take the argmax. Always computed: a flag for "some rows are greedy"
        # would double the sampler programs start-up loads, for a few ms at 256 rows.
        tokens = jnp.where(temperature > 0, tokens, _greedy(logits))
    token_logprobs, ranks = jnp.zeros(rows), jnp.zeros(rows, jnp.int32)
    top_logprobs, top_ids = jnp.zeros((rows, 0)), jnp.zeros((rows, 0), jnp.int32)
    if flags.logprobs:
        raw_logprobs = jax.nn.log_softmax(raw_logits, axis=-1)
        token_logprobs = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
        ranks = jnp.sum(raw_logprobs > token_logprobs[:, None], axis=-1) + 1
        if b.num_logprobs:
            top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, b.num_logprobs)
    return SamplerOutput(tokens, token_logprobs, ranks, top_ids, top_logprobs), spent


def _padded(rows: list[list[int]], fill: int, minimum: int = 1) -> np.ndarray:
    width = bucket(max((len(r) for r in rows), default=0), minimum) or minimum
    out = np.full((len(rows), width), fill, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def sampling_batch(requests: list, num_rows: int, vocab_size: int,
                   grammar_bitmask: np.ndarray | None = None) -> "SamplingBatch":
    """The sampling settings of `requests` (Sequences), one row each, padded to num_rows; `grammar_bitmask`
    holds the rows' grammar masks (GrammarCompiler.fill_bitmask) when some row follows a grammar."""
    params = [r.sampling_params for r in requests]
    pad = num_rows - len(requests)
    empty = [[] for _ in range(pad)]

    def column(values, dtype, fill):
        return np.array(list(values) + [fill] * pad, dtype)

    def ids(rows: list[list[int]], used: bool) -> np.ndarray:  # [num_rows, width] padded with V, or unused
        return _padded(rows + empty, vocab_size) if used else np.zeros((num_rows, 1), np.int32)

    banned = [_banned_tokens(r, p) for r, p in zip(requests, params)]
    biases = [list((p.logit_bias or {}).items()) for p in params]
    flags = SamplerFlags(
        all_greedy=all(p.greedy for p in params),
        top_k_or_p=any(not p.greedy and (p.top_k > 0 or p.top_p < 1) for p in params),
        penalties=any(p.uses_penalties for p in params),
        ban_tokens=any(banned),
        min_p=any(not p.greedy and p.min_p > 0 for p in params),
        logprobs=any(p.logprobs is not None for p in params),
        allowed_tokens=any(p.allowed_token_ids is not None for p in params),
        logit_bias=any(biases),
        structured=grammar_bitmask is not None,
    )
    bias_values = np.zeros((num_rows, 1), np.float32)
    if flags.logit_bias:
        bias_values = np.zeros(ids([[t for t, _ in b] for b in biases], True).shape, np.float32)
        for row, bias in enumerate(biases):
            bias_values[row, : len(bias)] = [v for _, v in bias]
    return SamplingBatch(
        temperature=column((p.temperature for p in params), np.float32, 0.0),
        top_k=column((max(p.top_k, 0) for p in params), np.int32, 0),
        top_p=column((p.top_p for p in params), np.float32, 1.0),
        min_p=column((p.min_p for p in params), np.float32, 0.0),
        seeds=column((r.seed for r in requests), np.uint32, 0),
        positions=column((r.num_tokens for r in requests), np.int32, 0),
        prompt_ids=ids([r.prompt_token_ids for r in requests], flags.penalties),
        output_ids=ids([r.output_token_ids for r in requests], flags.penalties),
        presence=column((p.presence_penalty for p in params), np.float32, 0.0),
        frequency=column((p.frequency_penalty for p in params), np.float32, 0.0),
        repetition=column((p.repetition_penalty for p in params), np.float32, 1.0),
        banned_ids=_padded(banned + empty, vocab_size),
        flags=flags,
        num_logprobs=bucket_logprobs(max((p.logprobs or 0 for p in params), default=0)),
        allowed_ids=ids([list(p.allowed_token_ids or ()) for p in params], flags.allowed_tokens),
        bias_ids=ids([[t for t, _ in b] for b in biases], flags.logit_bias),
        bias_values=bias_values,
        grammar_bitmask=(_padded_rows(grammar_bitmask, num_rows) if flags.structured
                         else np.zeros((num_rows, 1), np.int32)),
    )


def _padded_rows(bitmask: np.ndarray, num_rows: int) -> np.ndarray:
    """Padding rows allow every token."""
    padding = np.full((num_rows - len(bitmask), bitmask.shape[1]), ALL_ALLOWED, np.int32)
    return np.concatenate([bitmask, padding])


def _banned_tokens(seq, params) -> list[int]:
    """Tokens this row may not sample now: stop tokens before min_tokens, and the next token of every bad word
    whose other tokens end the output (reference.sampler.processed_logits)."""
    banned = []
    if seq.num_output_tokens < params.min_tokens:
        banned += list(params.stop_token_ids) + ([] if params.ignore_eos else list(seq.eos_token_ids))
    output = seq.output_token_ids
    for *prefix, last in params.bad_words_token_ids:
        if len(prefix) <= len(output) and list(output[len(output) - len(prefix):]) == prefix:
            banned.append(last)
    return banned


def bucket_logprobs(n: int) -> int:
    """0, or a power of two up to 20, so few logprob sizes compile."""
    return 0 if n == 0 else min(bucket(n), MAX_LOGPROBS)
