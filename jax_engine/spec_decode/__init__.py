"""Speculative decoding (vLLM's spec_decode): a proposer drafts tokens, one step verifies them all.

config.py checks `speculative_config`; ngram_proposer.py drafts by prompt lookup, draft_model.py with a draft
model over a KV cache of its own; speculator.py asks one of them after each step; verification.py turns the
sampler's rows into the accepted tokens. The oracle is reference/speculative.py.
"""

from jax_engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
