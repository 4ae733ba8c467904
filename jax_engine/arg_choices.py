"""The names EngineArgs' enumerated fields accept, apart from the modules that implement each one.

This module imports nothing, so config.py checks a flag without importing JAX: the API server of `jax-engine
serve` parses and checks EngineArgs, loads the tokenizer and serves HTTP, and never runs a model, so it never
imports JAX (~1.4 s of CPU at start-up, on the 2 cores its engine core loads the model on).
"""

DTYPES = ("float32", "bfloat16", "float16")  # and "auto": float32 on CPU, bfloat16 on accelerators
# vLLM's names ("auto": the model's dtype). Its "fp8" is e4m3; the 8-bit caches keep vLLM's default scale of 1.0
# (no calibrated scales).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = ("bf16", "int8", "gguf")  # and None: the weights keep the engine's dtype
ATTENTION_BACKENDS = ("auto", "xla", "cpu", "pallas")
