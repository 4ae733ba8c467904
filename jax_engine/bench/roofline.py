"""A short probe of this machine's float32 matmul peak and memory bandwidth, and the model's bounds.

Decoding reads every weight once per step and spends 2 x params FLOPs per token: at large batch the
matmul peak bounds throughput (peak / (2 x params) tokens/s); at batch 1 the memory bandwidth does
(bandwidth / weight bytes tokens/s).
"""

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Roofline:
    matmul_gflops: float
    bandwidth_gbps: float
    compute_bound_tokens_per_s: float  # large batch
    bandwidth_bound_tokens_per_s: float  # batch 1


def _best_time(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - started)
    return best


def matmul_gflops() -> float:
    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    return 2 * n**3 / _best_time(jax.jit(lambda x, y: x @ y), a, a) / 1e9


def bandwidth_gbps() -> float:
    big = jnp.ones((64 * 1024 * 1024,), jnp.float32)  # 256 MiB, far beyond the caches
    return big.nbytes / _best_time(jax.jit(jnp.sum), big) / 1e9


def measure(num_params: int, bytes_per_param: int = 4) -> Roofline:
    gflops, gbps = matmul_gflops(), bandwidth_gbps()
    return Roofline(gflops, gbps, gflops * 1e9 / (2 * num_params), gbps * 1e9 / (num_params * bytes_per_param))


def best(*probes: Roofline) -> Roofline:
    """The highest peak and bandwidth of several probes.

    A shared machine's speed drifts by tens of percent over minutes; a probe taken in a slow moment would
    make every run look closer to the bound than it is, so a run is set against the best probe around it.
    """
    return Roofline(*(max(getattr(p, name) for p in probes) for name in Roofline.__dataclass_fields__))
