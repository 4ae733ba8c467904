"""The sampler's input on the host: one row of settings per sequence, packed into fixed-shape arrays.

A batch picks one of the sampler's four programs (SamplerFlags) and, in the general one, switches its optional
stages on or off (STAGES). Every array's shape follows from the row count and the program alone: a request's
options change values, never shapes, so start-up compiles every program a request can need
(empty_sampling_batch gives their shapes).
"""

import dataclasses
import functools
from dataclasses import dataclass

import jax
import numpy as np

from jax_engine.input_checks import MAX_LOGIT_BIAS
from jax_engine.sample.allowed_tokens import allowed_token_mask
from jax_engine.structured_output.grammar import ALL_ALLOWED, bitmask_width

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


def sampling_batch(seqs: list, num_rows: int, vocab_size: int, grammar_bitmask: np.ndarray | None = None,
                   penalty_width: int | None = None) -> SamplingBatch:
    """The sampling settings of `seqs` (Sequences), one row each, padded to num_rows.

    Args:
        grammar_bitmask: the rows' grammar masks (GrammarCompiler.fill_bitmask) when some row follows a grammar.
        penalty_width: the width of penalty_ids, the engine's max_model_len (None: the longest row's length,
            for tests that call the sampler directly).
    """
    params = [r.sampling_params for r in seqs]
    mask = token_mask(seqs, vocab_size, grammar_bitmask)
    needs = {"token_mask": mask is not None,
             "logit_bias": any(p.logit_bias for p in params),
             "penalties": any(p.uses_penalties for p in params),
             "random": any(not p.greedy for p in params),
             "top_k_or_p": any(not p.greedy and (p.top_k > 0 or p.top_p < 1) for p in params),
             "min_p": any(not p.greedy and p.min_p > 0 for p in params),
             "logprobs": any(p.logprobs is not None for p in params)}
    general = any(needs[stage] for stage in ("token_mask", "logit_bias", "penalties", "min_p", "logprobs"))
    flags = GENERAL if general else SamplerFlags(all_greedy=not needs["random"], top_k_or_p=needs["top_k_or_p"])
    pad = num_rows - len(seqs)

    def column(values, dtype, fill):
        return np.array(list(values) + [fill] * pad, dtype)

    batch = empty_sampling_batch(num_rows, flags, vocab_size, penalty_width or max(
        (r.num_tokens for r in seqs), default=1))
    extra = {}
    if general:
        extra = {"stages": np.array([needs[stage] for stage in STAGES]),
                 **_bias_arrays(params, num_rows, vocab_size)}
        if mask is not None:
            extra["token_mask"] = _padded_rows(mask, num_rows)
        if needs["penalties"]:
            extra |= _penalty_arrays(seqs, batch.penalty_ids.shape, vocab_size)
    return dataclasses.replace(
        batch, **extra,
        temperature=column((p.temperature for p in params), np.float32, 0.0),
        top_k=column((max(p.top_k, 0) for p in params), np.int32, 0),
        top_p=column((p.top_p for p in params), np.float32, 1.0),
        min_p=column((p.min_p for p in params), np.float32, 0.0),
        seeds=column((r.seed for r in seqs), np.uint32, 0),
        positions=column((r.num_tokens for r in seqs), np.int32, 0),
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


def token_mask(seqs: list, vocab_size: int, grammar_bitmask: np.ndarray | None) -> np.ndarray | None:
    """[len(seqs), bitmask_width] int32: what each row may sample now (its grammar, its allowed_token_ids,
    less its banned tokens), or None when no row is restricted.

    A grammar row whose controls leave it nothing (min_tokens banning the EOS that is all a finished grammar
    allows; allowed_token_ids outside the grammar) keeps its grammar's mask: its output stays valid.
    """
    restricted = [(i, r) for i, r in enumerate(seqs) if r.sampling_params.allowed_token_ids is not None
                  or _banned_tokens(r, r.sampling_params)]
    if grammar_bitmask is None and not restricted:
        return None
    mask = (np.array(grammar_bitmask[: len(seqs)], np.int32) if grammar_bitmask is not None
            else np.full((len(seqs), bitmask_width(vocab_size)), ALL_ALLOWED, np.int32))
    for i, seq in restricted:
        params = seq.sampling_params
        row = mask[i].view(np.uint32).copy()
        if params.allowed_token_ids is not None:
            row &= allowed_token_mask(params, vocab_size)
        banned = np.array([t for t in _banned_tokens(seq, params) if t < vocab_size], np.int64)
        np.bitwise_and.at(row, banned // 32, ~(np.uint32(1) << (banned % 32).astype(np.uint32)))
        if seq.grammar is None or row.any():
            mask[i] = row.view(np.int32)
    return mask


def _bias_arrays(params: list, num_rows: int, vocab_size: int) -> dict:
    ids = np.full((num_rows, MAX_LOGIT_BIAS), vocab_size, np.int32)
    values = np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32)
    for row, p in enumerate(params):
        bias = list((p.logit_bias or {}).items())
        ids[row, : len(bias)] = [t for t, _ in bias]
        values[row, : len(bias)] = [v for _, v in bias]
    return {"bias_ids": ids, "bias_values": values}


def _penalty_arrays(seqs: list, shape: tuple[int, int], vocab_size: int) -> dict:
    ids = np.full(shape, vocab_size, np.int32)
    num_prompt = np.zeros(shape[0], np.int32)
    for row, r in enumerate(seqs):
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
