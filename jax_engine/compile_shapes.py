"""Start-up compilation: every shape a step can take, compiled before the engine accepts work.

vLLM captures CUDA graphs for its batch sizes at start-up so that no request waits for a capture. Here every
new shape of the jitted step is an XLA compile (~2 s for SmolLM2's 30 unrolled layers on 2 cores), which
would otherwise land in the middle of someone's stream. On the ragged layout (the CPU default) the step's
shapes follow from its token bucket alone, and the logits and sampler's from the number of rows sampled,
so start-up can list and compile them all: the model step for every token bucket up to
max_num_batched_tokens, and the logits and the common sampler variants (greedy; random, with and without
top-k/top-p, with and without greedy rows beside) for every row bucket up to max_num_seqs, and the block
copies of parallel samples. Rarer sampler variants (penalties, logprobs, min_p, min_tokens), prompt
logprobs and swapping compile on first use. JAX's persistent compilation cache
keeps every compile on disk, so a second start loads them instead of compiling.

The padded layout (xla, pallas) has shapes along more axes (decode rows, prefill chunk, context width); it
compiles on first use, and the cache still applies.
"""

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jax_engine import native
from jax_engine.attention.metadata import AttentionMetadata
from jax_engine.buckets import all_buckets, bucket, bucket_tokens
from jax_engine.model_runner import ModelRunner, _copy_blocks, _forward, _logits
from jax_engine.sampler import SamplerFlags, SamplingBatch, sample

logger = logging.getLogger(__name__)

# The sampler variants compiled at start-up: greedy; random; random with top-k/top-p; each random one also
# with some greedy rows in the batch.
STARTUP_SAMPLER_FLAGS = (
    SamplerFlags(all_greedy=True, top_k_or_p=False, penalties=False, ban_tokens=False),
    *(SamplerFlags(all_greedy=False, top_k_or_p=top, penalties=False, ban_tokens=False, any_greedy=greedy_rows)
      for top in (False, True) for greedy_rows in (False, True)),
)


def _step_inputs(runner: ModelRunner, num_tokens: int) -> tuple:
    """Arguments of `_forward` for a ragged step of `num_tokens` (values do not matter, only shapes)."""
    rows = min(num_tokens, runner.max_num_seqs)
    i32 = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    metadata = AttentionMetadata(i32(num_tokens), i32(num_tokens), i32(rows, runner.max_blocks_per_seq), i32(rows),
                                 i32(rows + 1), i32(0), i32(0, 0), 0)
    return (runner.model, runner.k_cache, runner.v_cache, i32(num_tokens), metadata, i32(runner.max_num_seqs))


def _sampling_batch(rows: int, flags: SamplerFlags) -> SamplingBatch:
    f32, i32 = (lambda fill: np.full(rows, fill, np.float32)), (lambda *shape: np.zeros(shape, np.int32))
    return SamplingBatch(f32(1.0), i32(rows), f32(1.0), f32(0.0), np.zeros(rows, np.uint32), i32(rows),
                         i32(rows, 1), i32(rows, 1), f32(0.0), f32(0.0), f32(1.0), i32(rows, 1), flags, 0)


def _lowered_programs(runner: ModelRunner, max_num_batched_tokens: int) -> list:
    """Every program to compile, lowered (tracing is not thread-safe; compiling is, and runs in parallel)."""
    # Called exactly as the model runner calls them (a keyword argument is a different jit signature).
    programs = [_forward.lower(*_step_inputs(runner, t), runner.backend.attend)
                for t in all_buckets(bucket_tokens, max_num_batched_tokens)]
    hidden = jax.ShapeDtypeStruct((runner.max_num_seqs, runner.model.cfg.hidden_size), runner.k_cache.dtype)
    for rows in all_buckets(bucket_tokens, runner.max_num_seqs):
        logits = jax.ShapeDtypeStruct((rows, runner.model.cfg.vocab_size), jnp.float32)
        programs.append(_logits.lower(runner.model, hidden, np.zeros(rows, np.int32), logits))
        programs += [sample.lower(logits, _sampling_batch(rows, flags), scratch=logits)
                     for flags in STARTUP_SAMPLER_FLAGS]
    for copies in all_buckets(lambda n: bucket(n, 8), runner.max_num_seqs):  # copy-on-write of forked blocks
        indices = np.zeros(copies, np.int32)
        programs.append(_copy_blocks.lower(runner.k_cache, runner.v_cache, indices, indices))
    return programs


def compile_step_shapes(runner: ModelRunner, max_num_batched_tokens: int, use_tqdm: bool = True) -> float:
    """Compile (or load from the persistent cache) every step shape; returns the seconds it took."""
    if not runner.backend.ragged:
        logger.info("attention backend %r pads its layout: step shapes compile on first use", runner.backend.name)
        return 0.0
    started = time.perf_counter()
    programs = _lowered_programs(runner, max_num_batched_tokens)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool, \
            tqdm(total=len(programs), desc="Compiling step shapes", disable=not use_tqdm) as bar:
        for _ in pool.map(lambda program: program.compile(), programs):
            bar.update()
    runner.compiled_shapes |= {((t,), (min(t, runner.max_num_seqs), runner.max_blocks_per_seq), (0,), (0, 0),
                                (runner.max_num_seqs,))
                               for t in all_buckets(bucket_tokens, max_num_batched_tokens)}
    seconds = time.perf_counter() - started
    logger.info("compiled %d programs for every step shape in %.1f s", len(programs), seconds)
    return seconds


def use_compilation_cache(directory: str) -> None:
    """Keep compiled programs in `directory` ("auto": under JAX_ENGINE_CACHE_DIR; "": no cache), process-wide.

    Every program is cached, however quick to compile: JAX's default skips those under a second, which would
    leave the sampler's and the logits' programs to compile again on every start.
    """
    from jax.experimental.compilation_cache import compilation_cache

    if directory == "":
        jax.config.update("jax_enable_compilation_cache", False)
        return
    path = str(native.cache_dir() / "xla") if directory == "auto" else os.path.expanduser(directory)
    if jax.config.jax_compilation_cache_dir not in (None, path):
        compilation_cache.reset_cache()  # another engine in this process used another directory
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
