"""The model runner's device programs, each declared once: its jitted function, the runner method that calls it,
how its key follows from its arguments, and example arguments for every shape start-up compiles.

    program          caller              shapes start-up compiles (up to StartupShapes)
    step             execute             every token bucket
    logits           sample              every row bucket
    sample           sample              every row bucket x the sampler's four programs (sample/sampling_batch.py)
    greedy           greedy_tokens       every row bucket, for a draft model's runner only (spec_decode/draft_model.py)
    token_logprobs   token_logprobs      SCORED_ROWS rows
    all_logits       all_logits          none (tests compare logits with it): compiled on first use
    copy             apply_block_moves   every bucket of blocks copied on write
    swap_out         apply_block_moves   every bucket of blocks swapped, when the engine preempts by swapping
    swap_in          apply_block_moves   the same

A program's key is its name and what sets its shapes. The runner calls each program through its ProgramCache
under `program.key(args)`; start-up (compile_shapes.py) compiles `program.startup_calls(...)` under the same keys,
so a step whose shapes start-up listed finds its program; multi-host workers repeat the calls of every program's
caller (distributed/multihost.py).
"""

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.attention.metadata import AttentionMetadata
from jax_engine.buckets import all_buckets, bucket, bucket_tokens
from jax_engine.sample.greedy_argmax import greedy_tokens
from jax_engine.sample.sampler import sample, token_logprobs
from jax_engine.sample.sampling_batch import SAMPLER_PROGRAMS, empty_sampling_batch

if TYPE_CHECKING:  # the runner imports this table; the examples only read its attributes
    from jax_engine.runner.model_runner import ModelRunner

# Prompt positions scored per call of _token_logprobs: one program, whatever a step's size.
SCORED_ROWS = 64


def block_move_bucket(num_blocks: int) -> int:
    """Blocks moved by one swap or copy, padded so that their counts share a few programs."""
    return bucket(num_blocks, 8)


# ------------------------------------------------------------------------------------ the jitted functions
@functools.partial(jax.jit, static_argnames=("attention",), donate_argnames=("k_cache", "v_cache"))
def _forward(flat_model, k_cache, v_cache, token_ids, lora_slots, metadata, logits_indices, attention):
    """The model (a FlatModel, as every program here takes it: flat_model.py) over the step's tokens (each with
    its LoRA adapter's slot, -1 for none); returns the hidden states of the sampling rows too.

    logits_indices has one entry per possible sampled row (max_sampled_rows), whatever the step's size, so this
    function, the costly one to compile, has one shape per token bucket and the logits one per row bucket.
    """
    hidden, k_cache, v_cache = flat_model.module()(token_ids, k_cache, v_cache, metadata, attention, lora_slots)
    return hidden[logits_indices], hidden, k_cache, v_cache


@functools.partial(jax.jit, donate_argnames=("logits_buffer",))
def _logits(flat_model, sampling_hidden, rows, live_rows, logits_buffer):
    # The rows past live_rows pad to the row bucket: the LM head skips them. Overwriting the whole donated
    # buffer makes XLA compute the logits straight into its memory.
    logits = flat_model.module().logits(sampling_hidden[rows], live_rows)
    return jax.lax.dynamic_update_slice(logits_buffer, logits, (0, 0))


@jax.jit
def _greedy_tokens(flat_model, sampling_hidden, rows):
    """Each row's most likely next token: a draft model's proposal, without the sampler or the logits on the host."""
    return greedy_tokens(flat_model.module().logits(sampling_hidden[rows]))


@jax.jit
def _all_logits(flat_model, hidden):
    return flat_model.module().logits(hidden)


@jax.jit
def _token_logprobs(flat_model, hidden, targets):
    """Log-probabilities of `targets` after each row of hidden states, their ranks, and the top MAX_LOGPROBS."""
    return token_logprobs(flat_model.module().logits(hidden), targets)


@functools.partial(jax.jit, donate_argnames=("k_cache", "v_cache"))
def _copy_blocks(k_cache, v_cache, src, dst):
    """Copy blocks src[i] -> dst[i]; a dst past the cache (padding) is dropped."""
    return (k_cache.at[:, dst].set(k_cache[:, src], mode="drop"),
            v_cache.at[:, dst].set(v_cache[:, src], mode="drop"))


@jax.jit
def _gather_blocks(cache, src):
    """Swap out: blocks src[i] of every layer, [L, len(src), ...]."""
    return cache[:, src]


@functools.partial(jax.jit, donate_argnames=("cache",))
def _scatter_blocks(cache, blocks, dst):
    """Swap in: blocks[:, i] into block dst[i] of every layer, in place; a dst past the cache (padding) is dropped."""
    return cache.at[:, dst].set(blocks, mode="drop")


# -------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class StartupShapes:
    """The most of each size a step can take: start-up compiles every bucket up to it."""

    max_tokens: int  # tokens computed in one step
    max_rows: int  # rows sampled in one step
    max_copies: int  # blocks copied on write in one step
    max_swaps: int  # blocks swapped out (or in) in one step; 0 when the engine does not swap


@dataclass(frozen=True)
class Example:
    """Arguments of one shape, passed as the runner passes them (a keyword argument is another jit signature);
    their values do not matter, and an array may be a ShapeDtypeStruct."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    size: int = 0  # along its program's dimension: tokens, rows or blocks


@dataclass(frozen=True)
class ProgramCall:
    """A program with arguments of one shape, filed under its key: what start-up lowers and compiles."""

    key: tuple
    fn: Callable
    args: tuple
    kwargs: dict
    static: tuple  # trailing static arguments: given to lower, not to the compiled program
    size: tuple[str, int] | None = None  # (dimension, size) that the runner pads to; None: a fixed shape

    def lower(self) -> jax.stages.Lowered:
        return self.fn.lower(*self.args, *self.static, **self.kwargs)


def _no_examples(runner: "ModelRunner", shapes: StartupShapes) -> Iterable[Example]:
    return ()


def _no_static(runner: "ModelRunner") -> tuple:
    return ()


@dataclass(frozen=True)
class DeviceProgram:
    """One device program of the model runner (see the module docstring)."""

    name: str  # the first item of its key; it names the program's stored executables too
    fn: Callable  # the jitted function
    caller: str  # the ModelRunner method that runs it: multi-host workers repeat that method's calls
    shapes_of: Callable[..., tuple]  # (its arguments) -> what sets its shapes: the rest of its key
    examples: Callable[["ModelRunner", StartupShapes], Iterable[Example]] = _no_examples  # a start-up shape each
    static: Callable[["ModelRunner"], tuple] = _no_static  # its trailing static arguments
    dimension: str | None = None  # the size its shapes follow (TOKENS, ROWS, COPIED, SWAPPED); None: fixed shapes

    def key(self, args: tuple, kwargs: dict | None = None) -> tuple:
        return (self.name, *self.shapes_of(*args, **(kwargs or {})))

    def startup_calls(self, runner: "ModelRunner", shapes: StartupShapes) -> list[ProgramCall]:
        static = self.static(runner)
        return [ProgramCall(self.key(e.args, e.kwargs), self.fn, e.args, e.kwargs, static,
                            (self.dimension, e.size) if self.dimension else None)
                for e in self.examples(runner, shapes)]


def _step_shapes(model, k_cache, v_cache, token_ids, lora_slots, metadata: AttentionMetadata, logits_indices) -> tuple:
    return (token_ids.shape, metadata.block_tables.shape, metadata.decode_token_index.shape,
            metadata.prefill_token_index.shape, logits_indices.shape)


def step_example(runner: "ModelRunner", num_tokens: int) -> Example:
    """Arguments of `_forward` for a ragged step of `num_tokens` tokens."""
    rows = min(num_tokens, runner.max_num_seqs)
    i32 = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    metadata = AttentionMetadata(i32(num_tokens), i32(num_tokens), i32(rows, runner.max_blocks_per_seq), i32(rows),
                                 i32(rows + 1), i32(0), i32(0, 0), 0)
    host_inputs = runner.placed((i32(num_tokens), i32(num_tokens), metadata, i32(runner.max_sampled_rows)))
    return Example((runner.flat_model, runner.k_cache, runner.v_cache, *host_inputs), size=num_tokens)


def _step_examples(runner: "ModelRunner", shapes: StartupShapes) -> Iterable[Example]:
    return (step_example(runner, tokens) for tokens in all_buckets(bucket_tokens, shapes.max_tokens))


def _replicated(runner: "ModelRunner", shape: tuple, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=runner.replicated)


def _logits_examples(runner: "ModelRunner", shapes: StartupShapes) -> Iterable[Example]:
    cfg = runner.model.cfg
    hidden = _replicated(runner, (runner.max_sampled_rows, cfg.hidden_size), runner.model.activation_dtype)
    for rows in all_buckets(bucket, shapes.max_rows):
        buffer = _replicated(runner, (rows, cfg.vocab_size), jnp.float32)
        host = runner.placed((np.zeros(rows, np.int32), np.int32(rows)))
        yield Example((runner.flat_model, hidden, *host, buffer), size=rows)


def _greedy_examples(runner: "ModelRunner", shapes: StartupShapes) -> Iterable[Example]:
    hidden = _replicated(runner, (runner.max_sampled_rows, runner.model.cfg.hidden_size), runner.model.activation_dtype)
    for rows in all_buckets(bucket, shapes.max_rows):
        yield Example((runner.flat_model, hidden, runner.placed(np.zeros(rows, np.int32))), size=rows)


def _sampler_shapes(logits, batch, scratch=None) -> tuple:
    leaves, tree = jax.tree.flatten(batch)  # the tree holds the flags, which pick one of the four programs
    return (tree, tuple(np.shape(x) for x in leaves))


def _sample_examples(runner: "ModelRunner", shapes: StartupShapes) -> Iterable[Example]:
    vocab_size = runner.model.cfg.vocab_size
    for rows in all_buckets(bucket, shapes.max_rows):
        logits = _replicated(runner, (rows, vocab_size), jnp.float32)
        for flags in SAMPLER_PROGRAMS:
            batch = empty_sampling_batch(rows, flags, vocab_size, runner.max_model_len)
            yield Example((logits, runner.placed(batch)), {"scratch": logits}, size=rows)


def _token_logprobs_examples(runner: "ModelRunner", shapes: StartupShapes) -> Iterable[Example]:
    hidden = np.zeros((SCORED_ROWS, runner.model.cfg.hidden_size), runner.model.activation_dtype)
    yield Example((runner.flat_model, *runner.placed((hidden, np.zeros(SCORED_ROWS, np.int32)))))


def _copy_examples(runner: "ModelRunner", shapes: StartupShapes) -> Iterable[Example]:
    for count in all_buckets(block_move_bucket, shapes.max_copies):
        indices = runner.placed(np.zeros(count, np.int32))
        yield Example((runner.k_cache, runner.v_cache, indices, indices), size=count)


def _swap_out_examples(runner: "ModelRunner", shapes: StartupShapes) -> Iterable[Example]:
    for count in all_buckets(block_move_bucket, shapes.max_swaps):
        yield Example((runner.k_cache, runner.placed(np.zeros(count, np.int32))), size=count)


def _swap_in_examples(runner: "ModelRunner", shapes: StartupShapes) -> Iterable[Example]:
    cache = runner.k_cache
    for count in all_buckets(block_move_bucket, shapes.max_swaps):
        blocks = jax.ShapeDtypeStruct((cache.shape[0], count, *cache.shape[2:]), cache.dtype, sharding=cache.sharding)
        yield Example((cache, blocks, runner.placed(np.zeros(count, np.int32))), size=count)


# The sizes the runner pads to, each a dimension of start-up's shapes (see staged_sizes.py); every program of a
# dimension has a program at each of its sizes (copies and swaps go up to different block counts).
TOKENS, ROWS, COPIED, SWAPPED = "tokens", "rows", "blocks copied", "blocks swapped"
STEP = DeviceProgram("step", _forward, "execute", _step_shapes, _step_examples,
                     static=lambda runner: (runner.backend.attend,), dimension=TOKENS)
LOGITS = DeviceProgram("logits", _logits, "sample", lambda model, hidden, rows, live, buffer: (rows.shape[0],),
                       _logits_examples, dimension=ROWS)
SAMPLE = DeviceProgram("sample", sample, "sample", _sampler_shapes, _sample_examples, dimension=ROWS)
GREEDY = DeviceProgram("greedy", _greedy_tokens, "greedy_tokens", lambda model, hidden, rows: (rows.shape[0],),
                       _greedy_examples, dimension=ROWS)
TOKEN_LOGPROBS = DeviceProgram("token_logprobs", _token_logprobs, "token_logprobs",
                               lambda model, hidden, targets: (targets.shape[0],), _token_logprobs_examples)
ALL_LOGITS = DeviceProgram("all_logits", _all_logits, "all_logits", lambda model, hidden: (hidden.shape,))
COPY = DeviceProgram("copy", _copy_blocks, "apply_block_moves", lambda k_cache, v_cache, src, dst: (src.shape[0],),
                     _copy_examples, dimension=COPIED)
SWAP_OUT = DeviceProgram("swap_out", _gather_blocks, "apply_block_moves", lambda cache, src: (src.shape[0],),
                         _swap_out_examples, dimension=SWAPPED)
SWAP_IN = DeviceProgram("swap_in", _scatter_blocks, "apply_block_moves", lambda cache, blocks, dst: (dst.shape[0],),
                        _swap_in_examples, dimension=SWAPPED)
DEVICE_PROGRAMS = (STEP, LOGITS, SAMPLE, GREEDY, TOKEN_LOGPROBS, ALL_LOGITS, COPY, SWAP_OUT, SWAP_IN)
# What start-up compiles for the model that serves (all but the draft's greedy), and for a draft model, which
# only steps and takes its argmax (its own cache is never copied or swapped: spec_decode/draft_model.py).
TARGET_PROGRAMS = tuple(program for program in DEVICE_PROGRAMS if program is not GREEDY)
DRAFT_PROGRAMS = (STEP, GREEDY)
# And for an embedding engine (task="embed"), which only steps: it pools the step's hidden states on the host
# (pooler.py), samples nothing, never forks (n=1), and is never preempted (a pooling request gets its whole
# prompt's blocks when admitted).
POOLING_PROGRAMS = (STEP,)
# The runner methods that run these programs: multi-host wiring repeats each such call on every host.
DEVICE_CALLS = frozenset(program.caller for program in DEVICE_PROGRAMS)
