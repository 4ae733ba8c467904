"""The runner's program cache: programs compiled after start-up are kept at most MAX_LATE_PROGRAMS at a time,
and evicting them frees their memory maps (through jax.jit alone, every shape's program stayed for good); start-up's
programs loaded in the background are each loaded once, a call taking the one it needs first."""

import functools
import logging
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.runner.program_cache import ProgramCache
from jax_engine.runner.staged_sizes import StagedSizes


@jax.jit
def _scaled_sum(x):
    return jnp.sum(jnp.tanh(x) * 3.0)


def _memory_maps() -> int:
    return len(Path("/proc/self/maps").read_text().splitlines())


def _run_shapes(cache: ProgramCache, sizes) -> None:
    for n in sizes:
        x = np.ones(n, np.float32)
        total = cache.call(("sum", n), _scaled_sum, (x,), cause=f"an array of {n}")
        np.testing.assert_allclose(float(total), np.tanh(1.0) * 3.0 * n, rtol=1e-5)


def test_late_programs_are_bounded_and_evicted_ones_are_freed(caplog):
    cache = ProgramCache(max_late_programs=4)
    with caplog.at_level(logging.INFO, logger="jax_engine.runner.program_cache"):
        _run_shapes(cache, range(1, 41))
    assert len(cache.late) <= 4 and cache.num_late_compiles == 40 and cache.num_evictions >= 36
    assert "compiled sum after start-up" in caplog.text and "an array of 40" in caplog.text
    before = _memory_maps()
    _run_shapes(cache, range(41, 141))  # 100 more programs compiled, 100 more evicted
    grown = _memory_maps() - before
    print(f"100 programs compiled and evicted: {grown:+d} memory maps")
    assert grown < 50  # without jax.clear_caches() on eviction: +900
    _run_shapes(cache, [140])  # the most recent one is served from the cache
    assert cache.num_late_compiles == 140 and cache.num_programs <= 4


def _loads(order: list, started: threading.Event, gate: threading.Event) -> dict:
    """Loaders of three programs (each adds its key's number), recording the order they ran in; the first says it
    has started, then waits for `gate`, so that the background thread is held inside it."""
    def loader(n):
        def load():
            if n == 0:
                started.set()
                gate.wait(timeout=30)
            order.append(n)
            return lambda x: x + n
        return load
    return {("add", n): loader(n) for n in range(3)}


def test_background_loading_loads_each_program_once_and_a_call_takes_its_own_first():
    order, started, gate, done = [], threading.Event(), threading.Event(), threading.Event()
    cache = ProgramCache()
    cache.load_in_background(_loads(order, started, gate), when_done=done.set)
    assert ("add", 2) in cache and ("add", 3) not in cache  # provided by start-up, though not loaded yet
    assert started.wait(timeout=30)
    # The thread is held loading program 0: a call of program 2 loads it at once, without waiting for 0.
    assert cache.call(("add", 2), None, (40,)) == 42 and order == [2]
    gate.set()
    assert done.wait(timeout=30)
    assert order == [2, 0, 1] and set(cache.startup) == {("add", n) for n in range(3)}  # each loaded once
    assert cache.call(("add", 1), None, (40,)) == 41 and cache.num_late_compiles == 0


def test_a_call_waits_for_the_program_the_background_thread_is_loading():
    order, started, gate = [], threading.Event(), threading.Event()
    cache = ProgramCache()
    cache.load_in_background(_loads(order, started, gate))
    assert started.wait(timeout=30)
    threading.Timer(0.2, gate.set).start()
    assert cache.call(("add", 0), None, (40,)) == 40 and order.count(0) == 1  # the thread's load, no second one


def test_a_size_steps_padded_past_compiles_first_and_the_others_wait_for_idle():
    """A cold server's background compiles (StagedSizes): the size a step padded past goes at once, even while
    steps run back to back; the others wait for a moment when no program runs."""
    order, done = [], threading.Event()
    loads = {("step", n): functools.partial(lambda n: order.append(n) or (lambda x: x + n), n) for n in (2, 4, 8)}
    sizes = StagedSizes({"tokens": {1, 2, 4, 8, 16}}, {key: ("tokens", key[1]) for key in loads})
    cache = ProgramCache()
    cache.startup[("step", 16)] = lambda x: x + 16
    assert sizes.padded("tokens", 8) == 16  # a step of 8 tokens runs as 16, and asks for 8
    cache.call(("step", 16), None, (0,))
    cache.load_in_background(loads, when_done=done.set, sizes=sizes)
    busy_until = time.monotonic() + 1.0
    while time.monotonic() < busy_until:  # steps back to back
        assert cache.call(("step", 16), None, (0,)) == 16
        time.sleep(0.01)
    assert order == [8] and sizes.padded("tokens", 8) == 8
    assert done.wait(timeout=30) and order == [8, 2, 4] and sizes.complete
