"""The OpenAI-compatible server: `jax-engine serve` (see app.py for the routes)."""
