"""bfloat16 and fp8 KV caches beside the float32 model: 2x and 4x the tokens."""

from jax_engine import LLM, SamplingParams

prompt = "The capital of France is"
greedy = SamplingParams(temperature=0, max_tokens=8)
for kv_cache_dtype in ("auto", "bfloat16", "fp8", "fp8_e5m2"):
    llm = LLM(kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=256 << 20,
              max_model_len=1024, enforce_eager=True)
    engine = llm.llm_engine
    [out] = llm.generate([prompt], greedy, use_tqdm=False)
    print(f"{kv_cache_dtype:8} cache {str(engine.runner.k_cache.dtype):13}: "
          f"{engine.stats()['num_blocks']} blocks, {out.outputs[0].text!r}")
