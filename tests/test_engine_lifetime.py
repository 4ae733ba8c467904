"""A dropped LLM frees its engine, and with it the KV cache (2 GiB on CPU by default), the moment its last reference
goes: no reference cycle may keep it for Python's garbage collector, which may run much later. A notebook that
builds one LLM after another, or a process that holds a few in turn (the test suite), must not stack caches."""

import gc
import weakref

import pytest

from jax_engine import LLM, SamplingParams

SMALL = dict(max_model_len=64, kv_cache_memory_bytes=1 << 20, enforce_eager=True)


def _weak_engine(checkpoint_dir: str, **kwargs) -> weakref.ref:
    """A weak reference to the engine of an LLM that served a request and was then dropped."""
    llm = LLM(checkpoint_dir, **SMALL, **kwargs)
    if kwargs.get("task") == "embed":
        llm.embed(["hello world"], use_tqdm=False)
    else:
        llm.generate(["hello world", "paged"], SamplingParams(max_tokens=4, n=2), use_tqdm=False)
    return weakref.ref(llm.llm_engine)


@pytest.mark.parametrize("kwargs", [{}, {"async_scheduling": True}, {"task": "embed"}],
                         ids=["generate", "async-scheduling", "embed"])
def test_a_dropped_llm_frees_its_engine_without_the_garbage_collector(tiny_checkpoint_dir, kwargs):
    gc.collect()
    gc.disable()
    try:
        engine = _weak_engine(tiny_checkpoint_dir, **kwargs)
        assert engine() is None, [type(r).__name__ for r in gc.get_referrers(engine())]
    finally:
        gc.enable()
