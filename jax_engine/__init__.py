"""The production engine: vLLM's API over a JAX model, a paged KV cache and continuous batching.

    from jax_engine import LLM, SamplingParams
    outputs = LLM().generate(["The capital of France is"], SamplingParams(temperature=0))

Names are imported lazily so `import jax_engine.loader` (NumPy only) does not start JAX.
"""

import importlib

_EXPORTS = {
    "LLM": "jax_engine.llm",
    "LLMEngine": "jax_engine.llm_engine",
    "AsyncLLMEngine": "jax_engine.async_llm_engine",
    "EngineArgs": "jax_engine.config",
    "SamplingParams": "jax_engine.sampling_params",
    "RequestOutput": "jax_engine.outputs",
    "CompletionOutput": "jax_engine.outputs",
    "Logprob": "jax_engine.outputs",
    "BeamSearchParams": "jax_engine.beam_search",
    "BeamSearchOutput": "jax_engine.beam_search",
    "LoRARequest": "jax_engine.lora.request",
    "PoolingParams": "jax_engine.pooling_params",
    "PoolerConfig": "jax_engine.pooling_params",
    "PoolingRequestOutput": "jax_engine.outputs",
    "EmbeddingRequestOutput": "jax_engine.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jax_engine' has no attribute {name!r}")
