"""Benchmarks, run as `jax-engine bench throughput | serve | sharing | kernels | batching | preemption | soak` (see docs/benchmarks.md)."""
