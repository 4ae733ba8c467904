"""Flax NNX models. One Llama-family implementation covers Llama / SmolLM, Mistral, Qwen2 and Qwen3."""

from jax_engine.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
