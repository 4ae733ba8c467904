"""The one place that loads checkpoints: GGUF files and HF checkpoint directories.

Everything here is NumPy only, so the reference oracle, the JAX engine and the tests all load the same
weights the same way. Weights come back under Hugging Face names with HF shapes ([out, in] for
projections), whatever the file format.
"""

from jax_engine.loader.checkpoint import Checkpoint, default_model_path, load_checkpoint

__all__ = ["Checkpoint", "default_model_path", "load_checkpoint"]
