"""Batched, jitted sampling: grammar bitmasks, token controls, penalties, temperature, top-k, top-p, min-p,
per-request seeds, logprobs.

Randomness: row r draws one uniform number from `fold_in(key(seed_r), position_r)` and inverts the
filtered distribution's CDF. A seeded request's token at a position therefore depends only on (seed,
position) and its logits, never on which other requests share the batch.
"""

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.sampling_params import MAX_LOGPROBS
from jax_engine.structured_output.grammar import ALL_ALLOWED, bitmask_width
from jax_engine.input_checks import MAX_LOGIT_BIAS

_NEG_INF = -jnp.inf


# The optional stages of the sampler, in the order they run. The general program has all of them compiled in,
# each switched on or off per batch by SamplingBatch.stages; the plain programs have only "random" and
# "top_k_or_p", fixed when compiled.
STAGES = ("token_mask", "logit_bias", "penalties", "random", "top_k_or_p", "min_p", "logprobs")


@dataclass(frozen=True)
class SamplerFlags:
    """Which of the sampler's programs runs a batch (static: each is compiled once, at start-up).

    Three plain programs cover the common batches with nothing optional compiled in: greedy, random, random
    with top-k/top-p. The general program runs every other batch. Its array shapes follow from the row count
    alone (vocabulary-wide masks, lists padded to their caps), so no request can make another program.
    """

    all_greedy: bool = False
    top_k_or_p: bool = False
    general: bool = False


GREEDY, RANDOM, RANDOM_TOP_K_OR_P, GENERAL = (SamplerFlags(all_greedy=True), SamplerFlags(),
                                              SamplerFlags(top_k_or_p=True), SamplerFlags(general=True))
SAMPLER_PROGRAMS = (GREEDY, RANDOM, RANDOM_TOP_K_OR_P, GENERAL)


@functools.partial(jax.tree_util.register_dataclass, meta_fields=("flags",),
                   data_fields=("temperature", "top_k", "top_p", "min_p", "seeds", "positions", "stages",
                                "token_mask", "bias_ids", "bias_values", "penalty_ids", "num_prompt_tokens",
                                "presence", "frequency", "repetition"))
@dataclass(frozen=True)
class SamplingBatch:
    """The sampler's input: one row per sequence (padded rows sample harmlessly and are dropped).

    The general program's arrays have fixed widths; a plain program's optional arrays are [R, 1] placeholders.
    """

    temperature: np.ndarray  # [R] float32
    top_k: np.ndarray  # [R] int32, 0 = all
    top_p: np.ndarray  # [R] float32
    min_p: np.ndarray  # [R] float32
    seeds: np.ndarray  # [R] uint32: each sequence's resolved seed
    positions: np.ndarray  # [R] int32: the position being sampled (the draw depends on seed and position)
    stages: np.ndarray  # [len(STAGES)] bool: the general program's stages this batch needs
    # [R, ceil(V / 32)] int32: bit t % 32 of word t // 32 allows token t. A row's grammar, allowed_token_ids,
    # and its banned tokens (stop tokens before min_tokens, bad words) in one mask, built on the host.
    token_mask: np.ndarray
    bias_ids: np.ndarray  # [R, MAX_LOGIT_BIAS] int32 logit_bias tokens, padded with V
    bias_values: np.ndarray  # [R, MAX_LOGIT_BIAS] float32 their biases
    penalty_ids: np.ndarray  # [R, max_model_len] int32: prompt then output tokens, padded with V
    num_prompt_tokens: np.ndarray  # [R] int32: how many of a row's penalty_ids are its prompt
    presence: np.ndarray  # [R] float32
    frequency: np.ndarray  # [R] float32
    repetition: np.ndarray  # [R] float32
    flags: SamplerFlags


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


@functools.partial(jax.jit, donate_argnames=("scratch",))
def sample(logits, batch: SamplingBatch, scratch=None) -> tuple[SamplerOutput, jax.Array | None]:
    """Sample one token per row.

    Args:
        logits: [R, V] float32 next-token logits.
        batch: the rows' sampling settings (see SamplingBatch); its flags are static and pick the program.
        scratch: optional donated [R, V] float32 buffer that the sampling weights are written into instead
            of a fresh array (see model_runner.RecycledBuffers).

    Returns:
        (the sampled tokens with their logprobs, the scratch buffer to hand back, or None); logprobs are of
        the model's raw distribution, as vLLM reports them, with the top MAX_LOGPROBS of each row (the host
        keeps as many as each request asked for), and zeros unless some row asked for logprobs.
    """
    b, flags = batch, batch.flags
    rows, vocab = logits.shape
    row_index = jnp.arange(rows)[:, None]

    def on(stage: str):
        if flags.general:
            return b.stages[STAGES.index(stage)]
        return {"random": not flags.all_greedy, "top_k_or_p": flags.top_k_or_p}.get(stage, False)

    # The token mask first (a grammar's mask comes before vLLM's sampler, then the token controls in vLLM's
    # order: reference.sampler.processed_logits), then the biases, then the penalties.
    masked = _when(on("token_mask"), lambda x: jnp.where(_unpack_bitmask(b.token_mask, vocab), x, _NEG_INF), logits)
    biased = _when(on("logit_bias"), lambda x: x.at[row_index, b.bias_ids].add(b.bias_values, mode="drop"), masked)
    final = _when(on("penalties"), lambda x: _apply_penalties(x, b.penalty_ids, b.num_prompt_tokens, b.presence,
                                                              b.frequency, b.repetition), biased)

    def drawn(final, scratch):
        scaled = final / jnp.where(b.temperature > 0, b.temperature, 1.0)[:, None]
        scaled = _when(on("top_k_or_p"), lambda s: _top_k_top_p_mask(s, b.top_k, b.top_p), scaled)
        # Unnormalised probabilities suffice: the draw compares against a fraction of their total.
        weights = jnp.exp(scaled - scaled.max(axis=-1, keepdims=True))
        # The max weight is exactly 1, so min_p compares with the weights themselves.
        weights = _when(on("min_p"), lambda w: jnp.where(w >= b.min_p[:, None], w, 0.0), weights)
        tokens = _draw(weights, b.seeds, b.positions).astype(jnp.int32)
        if scratch is not None:  # XLA then computes the weights straight into the scratch's memory
            scratch = jax.lax.dynamic_update_slice(scratch, weights, (0, 0))
        # Greedy rows beside random ones take the argmax. Always computed: a flag for "some rows are greedy"
        # would double the sampler programs, for a few ms at 256 rows.
        return jnp.where(b.temperature > 0, tokens, _greedy(final)), scratch

    tokens, spent = _either(on("random"), drawn, lambda final, scratch: (_greedy(final), scratch), final, scratch)

    def without_logprobs(tokens):
        top = min(MAX_LOGPROBS, vocab) if flags.general else 0
        return (jnp.zeros(rows), jnp.zeros(rows, jnp.int32), jnp.zeros((rows, top), jnp.int32),
                jnp.zeros((rows, top)))

    logprobs = _either(on("logprobs"), lambda tokens: token_logprobs(logits, tokens), without_logprobs, tokens)
    return SamplerOutput(tokens, *logprobs), spent


def token_logprobs(logits, tokens):
    """(logprob of each row's token, its rank, the top MAX_LOGPROBS ids and their logprobs) under the model's raw
    distribution, as vLLM reports them."""
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    ranks = jnp.sum(raw_logprobs > chosen[:, None], axis=-1).astype(jnp.int32) + 1
    top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    return chosen, ranks, top_ids.astype(jnp.int32), top_logprobs


# ----------------------------------------------------------------------------------- host side
def sampling_batch(requests: list, num_rows: int, vocab_size: int, grammar_bitmask: np.ndarray | None = None,
                   penalty_width: int | None = None) -> SamplingBatch:
    """The sampling settings of `requests` (Sequences), one row each, padded to num_rows.

    Args:
        grammar_bitmask: the rows' grammar masks (GrammarCompiler.fill_bitmask) when some row follows a grammar.
        penalty_width: the width of penalty_ids, the engine's max_model_len (None: the longest row's length,
            for tests that call the sampler directly).
    """
    params = [r.sampling_params for r in requests]
    mask = token_mask(requests, vocab_size, grammar_bitmask)
    needs = {"token_mask": mask is not None,
             "logit_bias": any(p.logit_bias for p in params),
             "penalties": any(p.uses_penalties for p in params),
             "random": any(not p.greedy for p in params),
             "top_k_or_p": any(not p.greedy and (p.top_k > 0 or p.top_p < 1) for p in params),
             "min_p": any(not p.greedy and p.min_p > 0 for p in params),
             "logprobs": any(p.logprobs is not None for p in params)}
    general = any(needs[stage] for stage in ("token_mask", "logit_bias", "penalties", "min_p", "logprobs"))
    flags = GENERAL if general else SamplerFlags(all_greedy=not needs["random"], top_k_or_p=needs["top_k_or_p"])
    pad = num_rows - len(requests)

    def column(values, dtype, fill):
        return np.array(list(values) + [fill] * pad, dtype)

    batch = empty_sampling_batch(num_rows, flags, vocab_size, penalty_width or max(
        (r.num_tokens for r in requests), default=1))
    extra = {}
    if general:
        extra = {"stages": np.array([needs[stage] for stage in STAGES]),
                 **_bias_arrays(params, num_rows, vocab_size)}
        if mask is not None:
            extra["token_mask"] = _padded_rows(mask, num_rows)
        if needs["penalties"]:
            extra |= _penalty_arrays(requests, batch.penalty_ids.shape, vocab_size)
    return dataclasses.replace(
        batch, **extra,
        temperature=column((p.temperature for p in params), np.float32, 0.0),
        top_k=column((max(p.top_k, 0) for p in params), np.int32, 0),
        top_p=column((p.top_p for p in params), np.float32, 1.0),
        min_p=column((p.min_p for p in params), np.float32, 0.0),
        seeds=column((r.seed for r in requests), np.uint32, 0),
        positions=column((r.num_tokens for r in requests), np.int32, 0),
        presence=column((p.presence_penalty for p in params), np.float32, 0.0),
        frequency=column((p.frequency_penalty for p in params), np.float32, 0.0),
        repetition=column((p.repetition_penalty for p in params), np.float32, 1.0))


def empty_sampling_batch(num_rows: int, flags: SamplerFlags, vocab_size: int, penalty_width: int) -> SamplingBatch:
    """A batch of `num_rows` padding rows with the shapes of `flags`' program (start-up compiles from these)."""
    f32, i32 = (lambda fill: np.full(num_rows, fill, np.float32)), (lambda *shape: np.zeros(shape, np.int32))
    widths = ((bitmask_width(vocab_size), MAX_LOGIT_BIAS, penalty_width) if flags.general else (1, 1, 1))
    mask_width, bias_width, penalty_width = widths
    return SamplingBatch(
        temperature=f32(0.0), top_k=i32(num_rows), top_p=f32(1.0), min_p=f32(0.0),
        seeds=np.zeros(num_rows, np.uint32), positions=i32(num_rows), stages=np.zeros(len(STAGES), bool),
        token_mask=np.full((num_rows, mask_width), ALL_ALLOWED, np.int32),
        bias_ids=np.full((num_rows, bias_width), vocab_size, np.int32),
        bias_values=np.zeros((num_rows, bias_width), np.float32),
        penalty_ids=np.full((num_rows, penalty_width), vocab_size, np.int32), num_prompt_tokens=i32(num_rows),
        presence=f32(0.0), frequency=f32(0.0), repetition=f32(1.0), flags=flags)


def token_mask(requests: list, vocab_size: int, grammar_bitmask: np.ndarray | None) -> np.ndarray | None:
    """[len(requests), bitmask_width] int32: what each row may sample now (its grammar, its allowed_token_ids,
    less its banned tokens), or None when no row is restricted.

    A grammar row whose controls leave it nothing (min_tokens banning the EOS that is all a finished grammar
    allows; allowed_token_ids outside the grammar) keeps its grammar's mask: its output stays valid.
    """
    restricted = [(i, r) for i, r in enumerate(requests) if r.sampling_params.allowed_token_ids is not None
                  or _banned_tokens(r, r.sampling_params)]
    if grammar_bitmask is None and not restricted:
        return None
    mask = (np.array(grammar_bitmask[: len(requests)], np.int32) if grammar_bitmask is not None
            else np.full((len(requests), bitmask_width(vocab_size)), ALL_ALLOWED, np.int32))
    for i, request in restricted:
        params = request.sampling_params
        row = mask[i].view(np.uint32).copy()
        if params.allowed_token_ids is not None:
            row &= allowed_token_mask(params, vocab_size)
        banned = np.array([t for t in _banned_tokens(request, params) if t < vocab_size], np.int64)
        np.bitwise_and.at(row, banned // 32, ~(np.uint32(1) << (banned % 32).astype(np.uint32)))
        if request.grammar is None or row.any():
            mask[i] = row.view(np.int32)
    return mask


def allowed_token_mask(params, vocab_size: int) -> np.ndarray:
    """[bitmask_width] uint32: the bits of params.allowed_token_ids, made once per request (a request may
    list up to 2^20 ids; its rows then cost one AND per step)."""
    if getattr(params, "allowed_mask", None) is None:
        ids = np.unique(np.asarray(params.allowed_token_ids, np.int64))
        ids = ids[ids < vocab_size]
        row = np.zeros(bitmask_width(vocab_size), np.uint32)
        np.bitwise_or.at(row, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
        params._set("allowed_mask", row)
    return params.allowed_mask


def _bias_arrays(params: list, num_rows: int, vocab_size: int) -> dict:
    ids = np.full((num_rows, MAX_LOGIT_BIAS), vocab_size, np.int32)
    values = np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32)
    for row, p in enumerate(params):
        bias = list((p.logit_bias or {}).items())
        ids[row, : len(bias)] = [t for t, _ in bias]
        values[row, : len(bias)] = [v for _, v in bias]
    return {"bias_ids": ids, "bias_values": values}


def _penalty_arrays(requests: list, shape: tuple[int, int], vocab_size: int) -> dict:
    ids = np.full(shape, vocab_size, np.int32)
    num_prompt = np.zeros(shape[0], np.int32)
    for row, r in enumerate(requests):
        if r.sampling_params.uses_penalties:
            tokens = r.all_token_ids
            ids[row, : len(tokens)] = tokens
            num_prompt[row] = r.num_prompt_tokens
    return {"penalty_ids": ids, "num_prompt_tokens": num_prompt}


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
