"""Run the engine's NNX model on one sequence through the real model runner (chunks, shuffled cache)."""

import jax.numpy as jnp
import numpy as np

from jax_engine.attention import get_attention_backend
from jax_engine.core.scheduler import ScheduledSequence, SchedulerOutput
from jax_engine.model_runner import ModelRunner
from jax_engine.models import CausalLM
from jax_engine.outputs import RequestMetrics
from jax_engine.sampling_params import SamplingParams
from jax_engine.sequence import Sequence


def engine_logits(checkpoint, token_ids: list[int], chunk_sizes: list[int], block_size: int = 4,
                  backend: str = "xla", dtype=jnp.float32, quantization: str | None = None,
                  mesh=None) -> np.ndarray:
    """Logits at every position, computed chunk by chunk through ModelRunner.prepare/execute (the model split
    over `mesh`, when given)."""
    model = CausalLM.from_hf_weights(checkpoint.config, checkpoint.weights, dtype, quantization, checkpoint.blocks,
                                     mesh)
    num_blocks = -(-len(token_ids) // block_size) + 2
    runner = ModelRunner(model, num_blocks, block_size, 0, len(token_ids) + 8, 1, get_attention_backend(backend, "cpu"),
                         dtype)
    table = [int(b) for b in np.random.default_rng(0).permutation(num_blocks)]
    seq = Sequence("r", "r", 0, list(token_ids), SamplingParams(), 0, 0, 1, (), None, RequestMetrics(0.0))
    logits = []
    for size in chunk_sizes:
        out = SchedulerOutput(scheduled=[ScheduledSequence(seq, size)])
        inputs = runner.prepare(out, {"r": table})
        _, hidden = runner.execute(inputs)
        logits.append(runner.all_logits(hidden)[:size])
        seq.num_computed_tokens += size
    return np.concatenate(logits)
