"""Picking an attention backend: "auto" resolves by platform, each name to an AttentionBackend."""

import functools
import logging

from jax_engine.arg_choices import ATTENTION_BACKENDS
from jax_engine.attention import cpu, pallas, xla
from jax_engine.attention.metadata import AttentionBackend

logger = logging.getLogger(__name__)

# 16 tokens per block is vLLM's GPU default. The cpu kernel streams each sequence's blocks from memory, and
# scattered small blocks read slower than long runs: attention alone over 256 sequences x 320 tokens (30
# layers, 6 GB cache) took 220-250 ms with scattered 16-token blocks, 160-190 ms with 64 or 128, 147 ms in
# order. End to end the gain is a few percent (docs/benchmarks.md). vLLM's CPU platform also picks bigger
# blocks. Not bigger here: a sequence wastes half a block on average, and prompt prefixes are cached in whole
# blocks.
XLA = AttentionBackend("xla", xla.paged_attention, ragged=False, default_block_size=16)
CPU = AttentionBackend("cpu", cpu.paged_attention, ragged=True, default_block_size=64)


def get_attention_backend(name: str, platform: str) -> AttentionBackend:
    """Resolve "auto" and return the backend.

    "auto" is pallas on GPU, the cpu kernel backend on CPU when its kernel builds, and xla otherwise.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        name = "pallas" if platform == "gpu" else "cpu" if platform == "cpu" and _cpu_kernel_ready() else "xla"
    if name == "pallas":  # interpreted on CPU: exact but slow, for tests
        return _pallas(platform)
    if name == "cpu":
        reason = f"it runs on CPU, not {platform!r}" if platform != "cpu" else cpu.kernel_unavailable_reason()
        if reason:
            raise ValueError(f"attention_backend 'cpu' is unavailable: {reason}")
        return CPU
    return XLA


def _cpu_kernel_ready() -> bool:
    reason = cpu.kernel_unavailable_reason()
    if reason:
        logger.warning("CPU paged-attention kernel unavailable, using the xla backend: %s", reason)
    return reason is None


@functools.cache
def _pallas(platform: str) -> AttentionBackend:
    # One backend per platform (compiled on GPU, interpreted elsewhere), so every engine shares its jit cache.
    return AttentionBackend("pallas", pallas.make_backend(platform), ragged=False, default_block_size=16)
