"""The runner's program cache: programs compiled after start-up are kept at most MAX_LATE_PROGRAMS at a time,
and evicting them frees their memory maps (through jax.jit alone, every shape's program stayed for good)."""

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.runner.program_cache import ProgramCache


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
