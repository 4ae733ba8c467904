"""The step updates the paged KV cache in place: its compiled program copies no cache-sized array, whatever the
number of KV heads. With one KV head (multi-query attention: Gemma 3 270M, StarCoder, Falcon-7B) XLA once copied
both caches whole into and out of every step, 2 GiB a token for Gemma 3 270M; such a head is now cached twice
(CausalLM.cache_heads_per_device), each copy serving half the query heads. (Falcon-7B's 71 query heads do not
split in two: it still copies.)"""

import math
import re

import pytest

from jax_engine import EngineArgs, LLMEngine, SamplingParams
from jax_engine.runner.device_programs import STEP
from tests.quick_compiles import users_compiled_text
from tests.tiny_checkpoints import make_tiny_checkpoint


def cache_copies(engine: LLMEngine) -> int:
    """Copies or conversions of cache-sized arrays (in any shape or dtype) in the compiled program of the
    engine's next step."""
    runner = engine.runner
    inputs = runner.prepare(engine.scheduler.schedule())
    args = (runner.flat_model, runner.k_cache, runner.v_cache, inputs.token_ids, inputs.lora_slots, inputs.metadata,
            inputs.logits_indices)
    text = users_compiled_text(STEP.fn.lower(*args, *STEP.static(runner)))
    outputs = [re.search(r"= \w+\[([\d,]+)\]", line) for line in text.splitlines()
               if re.search(r" (copy|convert|bitcast-convert)\(", line)]
    return sum(1 for out in outputs if out and math.prod(map(int, out[1].split(","))) == runner.k_cache.size)


@pytest.mark.parametrize("architecture, kv_heads", [("llama", 1), ("llama", 2), ("gemma3_text", 1)])
def test_the_step_copies_no_cache(tmp_path, architecture, kv_heads):
    make_tiny_checkpoint(tmp_path, architecture, num_key_value_heads=kv_heads)
    engine = LLMEngine(EngineArgs(str(tmp_path), max_model_len=64, enforce_eager=True, max_num_seqs=2,
                                  kv_cache_memory_bytes=1 << 24))
    assert engine.runner.k_cache.shape[3] == 2  # one head is cached twice
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=4))
    engine.step()  # the prompt; the next step decodes
    assert cache_copies(engine) == 0


@pytest.mark.parametrize("dtype, kv_cache_dtype", [("float32", "bfloat16"), ("bfloat16", "auto"), ("float16", "auto"),
                                                   ("float32", "fp8"), ("bfloat16", "fp8_e5m2")])
def test_a_narrow_cache_is_written_in_place(tmp_path, dtype, kv_cache_dtype):
    """XLA:CPU has no 16- or 8-bit float scatter: it widened the whole cache to float32 and back in every layer
    of every step. The cpu backend writes such a cache with its own kernel (attention/cpu_kernel/write_kv.cc)."""
    make_tiny_checkpoint(tmp_path, "llama", num_key_value_heads=2)
    engine = LLMEngine(EngineArgs(str(tmp_path), max_model_len=64, enforce_eager=True, max_num_seqs=2,
                                  kv_cache_memory_bytes=1 << 24, dtype=dtype, kv_cache_dtype=kv_cache_dtype))
    assert engine.attention_backend.name == "cpu" and engine.runner.k_cache.dtype.itemsize < 4
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=4))
    engine.step()
    assert cache_copies(engine) == 0
