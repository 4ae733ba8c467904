"""The one place that loads checkpoints: GGUF files and HF checkpoint directories.

Nothing here imports JAX: weights come back as NumPy arrays, so the reference oracle, the JAX engine and the
tests all load the same weights the same way. Weights come back under Hugging Face names with HF shapes ([out, in] for
projections), whatever the file format.
"""

from jax_engine.loader.checkpoint import Checkpoint
from jax_engine.loader.load import default_model_path, load_checkpoint, load_engine_checkpoint

__all__ = ["Checkpoint", "default_model_path", "load_checkpoint", "load_engine_checkpoint"]
