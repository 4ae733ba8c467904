"""Run the engine's NNX model on one sequence through the real model runner (chunks, shuffled cache)."""

import jax.numpy as jnp
import numpy as np

from jax_engine.attention import get_attention_backend
from jax_engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
from jax_engine.lora.layout import LoRALayout
from jax_engine.lora.request import LoRARequest
from jax_engine.runner.model_runner import ModelRunner
from jax_engine.models.causal_lm import CausalLM
from jax_engine.outputs import RequestMetrics
from jax_engine.sampling_params import SamplingParams
from jax_engine.sequence import Sequence


def sequence(seq_id: str, prompt: list[int], max_tokens: int = 16, params: SamplingParams | None = None,
             arrival: int = 0, eos_token_ids: tuple[int, ...] = (), priority: int = 0) -> Sequence:
    """A bare engine Sequence (no detokenizer) for driving the scheduler or the runner directly."""
    return Sequence(seq_id, seq_id, 0, list(prompt), params or SamplingParams(max_tokens=max_tokens), arrival, 0,
                    max_tokens, eos_token_ids, None, RequestMetrics(0.0), priority=priority)


def engine_logits(checkpoint, token_ids: list[int], chunk_sizes: list[int], block_size: int = 4,
                  backend: str = "xla", dtype=jnp.float32, quantization: str | None = None,
                  mesh=None, lora_request: LoRARequest | None = None) -> np.ndarray:
    """Logits at every position, computed chunk by chunk through ModelRunner.prepare/execute (the model split
    over `mesh`, when given; with the LoRA adapter of `lora_request`, one of two slots)."""
    model = CausalLM.from_hf_weights(checkpoint.config, checkpoint.weights, dtype, quantization, checkpoint.blocks,
                                     mesh)
    if lora_request is not None:
        model.add_lora_slots(LoRALayout.of(checkpoint.config, checkpoint.weights, max_loras=2, max_rank=16))
    num_blocks = -(-len(token_ids) // block_size) + 2
    runner = ModelRunner(model, num_blocks, block_size, 0, len(token_ids) + 8, 1, get_attention_backend(backend, "cpu"),
                         dtype, max_cpu_loras=2)
    table = [int(b) for b in np.random.default_rng(0).permutation(num_blocks)]
    seq = sequence("r", token_ids, max_tokens=1)
    seq.lora_request = lora_request
    logits = []
    for size in chunk_sizes:
        out = SchedulerOutput(scheduled=[ScheduledSequence(seq, size, table)])
        inputs = runner.prepare(out)
        _, hidden = runner.execute(inputs)
        logits.append(runner.all_logits(hidden)[:size])
        seq.num_computed_tokens += size
    return np.concatenate(logits)
