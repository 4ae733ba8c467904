"""Benchmarks, run as `jax-engine bench throughput | sharing | kernels` (see docs/benchmarks.md)."""
