"""The KV cache's plan, decided at start-up: its dtype, its block size, and how many blocks fit.

Each block holds the keys and values of `block_size` tokens in every layer. The budget (kv_cache_memory_bytes,
or what gpu_memory_utilization leaves beside the weights) divided by a block's bytes is the number of blocks;
the host pool for swapped-out blocks is swap_space over the same bytes. A cache in bfloat16 (or fp8) beside
float32 weights (kv_cache_dtype) halves (or quarters) a block's bytes: two (four) times the blocks in the same
budget, and that much less for attention to read each step.
"""

import logging
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.attention import AttentionBackend
from jax_engine.config import EngineArgs
from jax_engine.model_config import ModelConfig
from jax_engine.target_platform import platform
from simulator import capacity

if typing.TYPE_CHECKING:
    from jax_engine.models.causal_lm import CausalLM

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES = {"bfloat16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn,
                   "fp8_e5m2": jnp.float8_e5m2}  # arg_choices.KV_CACHE_DTYPES, less "auto"

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 2 * GiB


def resolve_kv_cache_dtype(name: str, model_dtype):
    """The cache's dtype: the model's for "auto", else the one named (EngineArgs.kv_cache_dtype)."""
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def resolve_block_size(block_size: int | None, backend: AttentionBackend) -> int:
    return block_size or backend.default_block_size


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype, kv_heads: int | None = None) -> int:
    """K and V of `block_size` tokens in every layer, for `kv_heads` heads (a device's share; all by default)."""
    kv_heads = cfg.num_kv_heads if kv_heads is None else kv_heads
    return 2 * cfg.num_layers * block_size * kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def kv_cache_bytes(args: EngineArgs, weight_bytes: int) -> int:
    if args.kv_cache_memory_bytes is not None:
        return args.kv_cache_memory_bytes
    if platform() == "cpu":
        return DEFAULT_CPU_KV_CACHE_BYTES
    stats = jax.devices()[0].memory_stats() or {}
    # What the utilization allows, less the weights and a margin for activations: `jax-engine plan`'s arithmetic.
    return capacity.kv_cache_bytes(stats.get("bytes_limit", 16 * GiB), args.gpu_memory_utilization, weight_bytes)


def plan_kv_cache(args: EngineArgs, cfg: ModelConfig, dtype, backend: AttentionBackend,
                  max_model_len: int, kv_heads_per_device: int | None = None,
                  draft: "CausalLM | None" = None, lora_bytes: int = 0) -> tuple[int, int, int]:
    """(block size, device blocks, host swap blocks) for this model, its dtype (the weights'; the cache's is
    args.kv_cache_dtype), backend and memory budget.

    The budget is per device, as vLLM's: under tensor parallelism a block costs each device its own KV
    heads' share (`kv_heads_per_device`), and each holds 1 / tensor_parallel_size of the weights. A draft model
    (speculative decoding) has a cache of its own with as many blocks: each block is paid for in both. LoRA slots
    (`lora_bytes`) are weights too: on a GPU they come out of the KV cache's share.
    """
    block_size = resolve_block_size(args.block_size, backend)
    cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    block_bytes = bytes_per_block(cfg, block_size, cache_dtype, kv_heads_per_device)
    weight_bytes = cfg.num_params * np.dtype(dtype).itemsize // args.tensor_parallel_size + lora_bytes
    device_block_bytes = block_bytes  # the draft's blocks are never swapped: the host pool is the target's
    if draft is not None:
        device_block_bytes += bytes_per_block(draft.cfg, block_size, cache_dtype, draft.cache_heads_per_device)
        weight_bytes += draft.cfg.num_params * np.dtype(dtype).itemsize // args.tensor_parallel_size
    num_blocks = args.num_gpu_blocks_override or capacity.num_blocks(kv_cache_bytes(args, weight_bytes),
                                                                     device_block_bytes)
    num_host_blocks = int(args.swap_space * GiB) // block_bytes
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks of {block_size}) "
            f"but max_model_len is {max_model_len}: raise kv_cache_memory_bytes or lower max_model_len")
    logger.info("# %s blocks: %d, # host (swap) blocks: %d (%.2f GiB KV cache per device, %d tokens)",
                platform().upper(), num_blocks, num_host_blocks, num_blocks * device_block_bytes / GiB,
                num_blocks * block_size)
    return block_size, num_blocks, num_host_blocks
