"""Start-up compiles every step shape: a varied workload afterwards compiles nothing, and a second start
loads the compiled programs from the persistent cache instead of compiling them."""

import contextlib

import jax
import pytest
from jax import monitoring

from jax_engine import SamplingParams
from jax_engine.attention.cpu import kernel_unavailable_reason

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or kernel_unavailable_reason() is not None,
                                reason="start-up compiles the ragged layout of the CPU default backend")

SMALL = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, num_gpu_blocks_override=64)


@contextlib.contextmanager
def jax_events():
    """Names of the JAX monitoring events (compiles, cache hits) recorded inside the block."""
    seen = []

    def on_event(name, **_):
        seen.append(name)

    def on_duration(name, _secs, **_):
        seen.append(name)

    monitoring.register_event_listener(on_event)
    monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield seen
    finally:
        monitoring.unregister_event_listener(on_event)
        monitoring.unregister_event_duration_listener(on_duration)


def varied_workload(llm):
    """Prompt lengths from 1 token to past the step budget (chunked), greedy and random sampling with and
    without top-k/top-p, parallel samples (copy-on-write of a shared block), stop strings, seeds."""
    long_prompt = "Write a long story about a lighthouse keeper who finds a map. " * 6
    prompts = [[1], "Hi", "The capital of France is", long_prompt, "List three colours:", long_prompt[:120]]
    params = [SamplingParams(temperature=0, max_tokens=9), SamplingParams(temperature=0.8, seed=1, max_tokens=17),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=5, seed=2),
              SamplingParams(temperature=0, max_tokens=12, stop=["."]),
              SamplingParams(n=3, temperature=0.7, max_tokens=6, seed=3),
              SamplingParams(temperature=0, max_tokens=1)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    outputs += llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    return outputs


def test_after_start_up_a_varied_workload_compiles_nothing(make_llm, tmp_path):
    llm = make_llm(enforce_eager=False, compilation_cache_dir=str(tmp_path), **SMALL)
    assert llm.llm_engine.startup_compile_seconds > 0
    with jax_events() as events:
        outputs = varied_workload(llm)
    assert all(o.finished for o in outputs) and sum(len(c.token_ids) for o in outputs for c in o.outputs) > 100
    compiles = [e for e in events if e.endswith("backend_compile_duration") or "cache_" in e]
    assert compiles == []
    assert any(tmp_path.iterdir())  # the programs went to the persistent cache


def test_a_second_start_loads_from_the_persistent_cache(make_llm, tmp_path):
    jax.clear_caches()  # programs compiled earlier in this process would not be written to the new directory
    make_llm(enforce_eager=False, compilation_cache_dir=str(tmp_path), **SMALL)
    jax.clear_caches()  # forget the programs in memory, as a new process would
    with jax_events() as events:
        make_llm(enforce_eager=False, compilation_cache_dir=str(tmp_path), **SMALL)
    # 11 token buckets; 4 row buckets of one logits and five sampler programs each; one block-copy size
    assert events.count("/jax/compilation_cache/cache_hits") >= 11 + 4 * 6 + 1
    assert "/jax/compilation_cache/cache_misses" not in events


def test_enforce_eager_compiles_nothing_at_start_up(make_llm):
    llm = make_llm(enforce_eager=True, **SMALL)
    assert llm.llm_engine.startup_compile_seconds == 0 and not llm.llm_engine.runner.compiled_shapes
