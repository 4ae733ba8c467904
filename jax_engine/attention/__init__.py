"""Attention backends: every backend gets the same AttentionMetadata and returns [T, heads, head_dim]."""

from jax_engine.attention.backend import get_attention_backend
from jax_engine.attention.metadata import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
