"""Attention backends: every backend gets the same AttentionMetadata and returns [T, heads, head_dim]."""

from jax_engine.attention.backend import ATTENTION_BACKENDS, AttentionMetadata, get_attention_backend

__all__ = ["ATTENTION_BACKENDS", "AttentionMetadata", "get_attention_backend"]
