"""Flax NNX models: one decoder skeleton (causal_lm.py) and a file per family (models/registry.py lists them)."""

from jax_engine.models.causal_lm import CausalLM

__all__ = ["CausalLM"]
