"""Benchmarks, run as `jax-engine bench <name>` (`jax-engine bench --help` lists them; see docs/benchmarks.md)."""
