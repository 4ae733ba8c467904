"""Sampling (vLLM v1's sample/): the host side of a step's sampling (step_sampler.py), each sequence's settings
packed into fixed-shape arrays (sampling_batch.py), and the jitted sampler (sampler.py)."""
