"""Attention backends: every backend gets the same AttentionMetadata and returns [T, heads, head_dim]."""

from jax_engine.attention.backend import ATTENTION_BACKENDS, get_attention_backend
from jax_engine.attention.metadata import AttentionBackend, AttentionMetadata

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "get_attention_backend"]
