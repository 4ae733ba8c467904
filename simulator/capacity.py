"""How much KV cache a device holds: the arithmetic the engine's start-up (jax_engine/kv_cache_plan.py's plan_kv_cache)
and `jax-engine plan` share, so a plan and a served engine agree on the block count."""

from dataclasses import dataclass

GiB = 1 << 30
# What vLLM's profiling run finds the activations of a step to need, roughly; the engine keeps the same margin.
ACTIVATION_RESERVE_BYTES = GiB


def kv_cache_bytes(memory_bytes: float, gpu_memory_utilization: float, weight_bytes: float,
                   activation_reserve_bytes: float = ACTIVATION_RESERVE_BYTES) -> int:
    """Bytes left for the KV cache on a device: what the utilization allows, less the weights and the activations."""
    return max(int(gpu_memory_utilization * memory_bytes - weight_bytes - activation_reserve_bytes), 0)


def num_blocks(cache_bytes: float, bytes_per_block: float) -> int:
    """Whole blocks of `bytes_per_block` (K and V of block_size tokens in every layer) in `cache_bytes`."""
    return int(cache_bytes // bytes_per_block)


@dataclass(frozen=True)
class Capacity:
    """One device's memory plan, with its arithmetic."""

    memory_bytes: float
    gpu_memory_utilization: float
    weight_bytes: float
    kv_bytes_per_token: float
    block_size: int = 16
    activation_reserve_bytes: float = ACTIVATION_RESERVE_BYTES
    kv_cache_memory_bytes: float | None = None  # a fixed budget instead (the engine's kv_cache_memory_bytes, CPUs)

    @property
    def kv_cache_bytes(self) -> int:
        if self.kv_cache_memory_bytes is not None:
            return int(self.kv_cache_memory_bytes)
        return kv_cache_bytes(self.memory_bytes, self.gpu_memory_utilization, self.weight_bytes,
                              self.activation_reserve_bytes)

    @property
    def num_blocks(self) -> int:
        return num_blocks(self.kv_cache_bytes, self.kv_bytes_per_token * self.block_size)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def lines(self) -> list[str]:
        """The plan as an operator checks it, one step of arithmetic a line."""
        usable = self.gpu_memory_utilization * self.memory_bytes
        if self.kv_cache_memory_bytes is None:
            budget = [f"memory: {self.gpu_memory_utilization:g} x {self.memory_bytes / GiB:.1f} GiB = "
                      f"{usable / GiB:.2f} GiB",
                      f"  less weights {self.weight_bytes / GiB:.2f} GiB and activations "
                      f"{self.activation_reserve_bytes / GiB:.2f} GiB = {self.kv_cache_bytes / GiB:.2f} GiB of KV cache"]
        else:
            budget = [f"memory: weights {self.weight_bytes / GiB:.2f} GiB, KV cache {self.kv_cache_bytes / GiB:.2f} GiB "
                      "(kv_cache_memory_bytes)"]
        return [
            *budget,
            f"KV cache: {self.kv_cache_bytes / GiB:.2f} GiB / ({self.block_size} tokens x "
            f"{self.kv_bytes_per_token / 1024:.0f} KiB) = {self.num_blocks:,} blocks = {self.num_tokens:,} tokens",
        ]
