"""Flax NNX models: one decoder skeleton (causal_lm.py) and a file per family (models/registry.py lists them).

Import the modules themselves: the loaders read a family's configuration (rope_scaling.py, alibi.py) without
importing Flax or JAX.
"""
