"""Start-up compilation: every shape a step can take, compiled (or loaded) before the engine accepts work.

vLLM captures CUDA graphs for its batch sizes at start-up so that no request waits for a capture. Here every
new shape of the jitted step is an XLA compile (~0.5 s for SmolLM2's step on 2 cores), which would otherwise
land in the middle of someone's stream. On the ragged layout (the CPU default) the step's shapes follow from
its token bucket alone, and the logits and sampler's from the number of rows sampled,
so start-up can list them all: the model step for every token bucket up to max_num_batched_tokens, the
logits and the sampler's four programs (greedy; random, with and without top-k/top-p; the general one with
every optional stage) for every row bucket up to max_num_seqs, the prompt-logprob scorer, the block copies of
parallel samples (fewer where a small KV cache bounds them), and, with preemption_mode="swap", the swaps out
and in for every bucket of blocks. Each device program declares its start-up shapes beside it
(device_programs.py); this file bounds them and compiles them. No request option changes a shape
(sampling_batch.py), so after start-up nothing compiles on the ragged layout; what does (program_cache.py) is
logged with its cause.

Compiled programs are kept on disk twice over: in an ExecutableStore under our own key, which a second start
loads without tracing anything (jax_engine/runner/executable_store.py), and in JAX's persistent compilation cache,
which serves the programs compiled on first use.

The padded layout (xla, pallas) has shapes along more axes (decode rows, prefill chunk, context width); it
compiles on first use, and JAX's cache still applies.
"""

import contextlib
import functools
import logging
import os
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
from tqdm.auto import tqdm

from jax_engine import native
from jax_engine.buckets import coarse_cover
from jax_engine.runner.device_programs import COPIED, ROWS, SWAPPED, TOKENS, ProgramCall, StartupShapes
from jax_engine.runner.executable_store import ExecutableStore
from jax_engine.runner.model_runner import ModelRunner
from jax_engine.runner.staged_sizes import StagedSizes

logger = logging.getLogger(__name__)

# A cold server compiles a coarse cover of each dimension's sizes before it answers /health, padding each size
# left out at most these factors (buckets.coarse_cover), and the others in the background (staged_sizes.py).
# Rows sampled may pad further than tokens: the logits and the sampler's four programs of a row size take ~4
# times as long to compile as a step, and a padded row costs a fifth of a padded token's work (the logits'
# matmul, against a pass through every layer).
READY_FIRST_RATIO = {TOKENS: 4, ROWS: 8, COPIED: 4, SWAPPED: 4}


def startup_shapes(runner: ModelRunner, max_num_batched_tokens: int, swap: bool = False) -> StartupShapes:
    """The most of each size a step can take under the engine's limits and its KV cache."""
    # A step writes every token it computes into a slot of its own (blocks a step writes are never shared:
    # forks copy on write, and the prefix cache holds computed blocks only), and each block it copies goes to a
    # block of its own: a small KV cache bounds those shapes, whatever the limits. Not the rows sampled: the n
    # samples of a request all sample from their parent's row before they fork, up to max_num_seqs in all.
    num_blocks = runner.num_slots // runner.block_size
    return StartupShapes(max_tokens=min(max_num_batched_tokens, runner.num_slots), max_rows=runner.max_sampled_rows,
                         max_copies=min(runner.max_num_seqs, num_blocks),
                         max_swaps=min(num_blocks, runner.host_k.shape[1]) if swap else 0)


def startup_programs(runner: ModelRunner, max_num_batched_tokens: int, swap: bool = False) -> list[ProgramCall]:
    """Every program start-up provides: each of the runner's device programs (runner.device_programs: a draft
    model's runner has two) at each of its start-up shapes."""
    shapes = startup_shapes(runner, max_num_batched_tokens, swap)
    return [call for program in runner.device_programs for call in program.startup_calls(runner, shapes)]


def compile_step_shapes(runner: ModelRunner, max_num_batched_tokens: int, cache_dir: str = "auto",
                        use_tqdm: bool = True, swap: bool = False, background: bool = False) -> float:
    """Load or compile every program of `startup_programs` into runner.programs.startup (the swaps too when `swap`: the
    engine preempts by swapping); returns the seconds it took. `background` (a server's engine): if every program
    is stored, load them on a thread of their own instead, from now on (ProgramCache.load_in_background); if some
    must compile, compile a coarse cover of the sizes now and the others on that thread (staged_sizes.py)."""
    if not runner.backend.ragged:
        logger.info("attention backend %r pads its layout: step shapes compile on first use", runner.backend.name)
        return 0.0
    started = time.perf_counter()
    programs = startup_programs(runner, max_num_batched_tokens, swap)
    root = compilation_cache_path(cache_dir)
    store = ExecutableStore(root / "programs") if root else None
    paths = [store.path(p.key[0], p.args, p.kwargs, p.static) if store else None for p in programs]
    if background and store and all(path.exists() for path in paths):
        _load_in_background(runner, programs, paths, store, started)
        return time.perf_counter() - started
    bypass = contextlib.ExitStack()  # open until the last program compiles, here or in the background
    # Not over several hosts: each pads a block move or a draft's rows itself, and they must pad alike.
    staged = background and jax.process_count() == 1
    loaded, missing, later = _load_and_compile(programs, paths, store, staged, use_tqdm, bypass)
    runner.programs.startup |= {p.key: compiled for p, compiled in zip(programs, loaded) if compiled is not None}
    seconds = time.perf_counter() - started
    logger.info("start-up: %d programs (%d loaded, %d compiled) in %.1f s%s", len(programs) - len(later),
                len(programs) - len(missing), len(missing) - len(later), seconds,
                f"; {len(later)} more compile in the background" if later else "")
    if later:
        _compile_in_background(runner, programs, later, paths, store, bypass)
    else:
        bypass.close()
    return seconds


def _load_and_compile(programs: list[ProgramCall], paths: list, store: ExecutableStore | None, staged: bool,
                      use_tqdm: bool, bypass: contextlib.ExitStack) -> tuple[list, list[int], list[int]]:
    """Load the stored programs and compile the others, except, when `staged`, those `_compiled_later` leaves to
    the background. Returns (each program, None for those left; the indices not stored; those left)."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool, \
            tqdm(total=len(programs), desc="Compiling step shapes", disable=not use_tqdm) as bar:
        def load(path):
            compiled = store.load(path) if store else None
            bar.update(compiled is not None)
            return compiled

        loaded = list(pool.map(load, paths))
        missing = [i for i, compiled in enumerate(loaded) if compiled is None]
        later = _compiled_later(programs, missing) if staged else []
        bar.total -= len(later)
        bar.set_description("Compiling step shapes" if missing else "Loading step shapes")

        def compile_one(i, lowered):
            loaded[i] = _compiled(lowered, paths[i], store)
            bar.update()

        bypass.enter_context(_bypassing_jax_cache(store is not None and bool(missing)))
        # Tracing is not thread-safe, compiling is: this thread traces each program while the pool
        # compiles the ones before it.
        compiling = [pool.submit(compile_one, i, programs[i].lower()) for i in missing if i not in later]
        for future in compiling:
            future.result()
    return loaded, missing, later


def _compiled(lowered: jax.stages.Lowered, path: Path | None, store: ExecutableStore | None) -> jax.stages.Compiled:
    compiled = lowered.compile()
    if store:
        store.save(path, compiled)
    return compiled


def _compiled_later(programs: list[ProgramCall], missing: list[int]) -> list[int]:
    """Of the programs to compile, those a server compiles once it is ready: the sizes off each dimension's
    coarse cover (READY_FIRST_RATIO), smallest first."""
    first = {dimension: set(coarse_cover(sorted(sizes), READY_FIRST_RATIO[dimension]))
             for dimension, sizes in _sizes(programs).items()}
    later = [i for i in missing if programs[i].size and programs[i].size[1] not in first[programs[i].size[0]]]
    return sorted(later, key=lambda i: programs[i].size[::-1])


def _sizes(programs: list[ProgramCall]) -> dict[str, set[int]]:
    sizes = defaultdict(set)
    for program in programs:
        if program.size:
            sizes[program.size[0]].add(program.size[1])
    return sizes


def _compile_in_background(runner: ModelRunner, programs: list[ProgramCall], later: list[int], paths: list,
                           store: ExecutableStore | None, bypass: contextlib.ExitStack) -> None:
    """Compile (and store) programs[i] for i in `later` on a thread of their own, in that order; until a size's
    programs are all compiled, the runner pads to the next size ready. `bypass` closes after the last one."""
    started = time.perf_counter()

    def done() -> None:
        bypass.close()
        logger.info("start-up: the other %d programs compiled in the background in %.1f s: every size is ready",
                    len(later), time.perf_counter() - started)

    def compile_later(i: int) -> jax.stages.Compiled:
        return _compiled(programs[i].lower(), paths[i], store)

    compiles = {programs[i].key: functools.partial(compile_later, i) for i in later}
    pending = {programs[i].key: programs[i].size for i in later}
    runner.programs.load_in_background(compiles, done, StagedSizes(_sizes(programs), pending))


def _load_in_background(runner: ModelRunner, programs: list[ProgramCall], paths: list[Path], store: ExecutableStore,
                        started: float) -> None:
    """Every program's smallest shape first (a first request's step and sampler are among them), then the next.
    A step needs the KV cache's zeros, so the engine is not ready before they are written. XLA:CPU has written
    them already (~0.55 s for 2 GiB: it runs a program of under 1000 flops on the caller's thread); a backend
    that dispatches them asynchronously is waited for here."""
    jax.block_until_ready((runner.k_cache, runner.v_cache))
    names = [program.key[0] for program in programs]
    order = sorted(range(len(programs)), key=lambda i: names[:i].count(names[i]))

    def done() -> None:
        logger.info("start-up: %d programs (%d loaded, 0 compiled) in %.1f s, in the background", len(programs),
                    sum(programs[i].key in runner.programs.startup for i in order), time.perf_counter() - started)

    runner.programs.load_in_background({programs[i].key: functools.partial(store.load, paths[i]) for i in order}, done)


@contextlib.contextmanager
def _bypassing_jax_cache(bypass: bool):
    """Compile for real, not from JAX's persistent cache: an executable JAX loaded from its cache serializes
    without its machine code on XLA:CPU (running it after loading fails with "Function ... not found")."""
    from jax.experimental.compilation_cache import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    if not (bypass and enabled):
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once per process whether to use its cache; ask it again
    # And forget what this process compiled before (an eager engine's programs, loaded from JAX's cache): lowering
    # the same program again would hand back that executable, which the store cannot save whole either.
    jax.clear_caches()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def compilation_cache_path(directory: str) -> Path | None:
    """Where compiled programs are kept: "auto" is $JAX_ENGINE_CACHE_DIR/compiled; "" is nowhere."""
    if directory == "":
        return None
    return native.cache_dir() / "compiled" if directory == "auto" else Path(directory).expanduser()


def use_compilation_cache(directory: str) -> None:
    """Keep the programs JAX compiles in its persistent cache under `directory`, process-wide.

    Every program is cached, however quick to compile: JAX's default skips those under a second, which would
    leave the rarer sampler variants to compile again on every start.
    """
    from jax.experimental.compilation_cache import compilation_cache

    root = compilation_cache_path(directory)
    if root is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    path = str(root / "xla")
    if jax.config.jax_compilation_cache_dir not in (None, path):
        compilation_cache.reset_cache()  # another engine in this process used another directory
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
