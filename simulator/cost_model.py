"""How long a step takes: a roofline over the weights, the KV cache a step attends over, and its FLOPs.

A decoding step reads every weight once whatever the batch, and each sequence's K and V once per layer; it
computes 2 FLOPs per parameter per token, and 4 per layer per head dimension per (query, key) pair in attention.
Whichever of reading and computing takes longer sets the step's time (they overlap on a GPU), plus fixed costs
per step (scheduling, kernel launches) and per sequence in the step (sampling, detokenizing, bookkeeping), which
the roofline cannot see.
"""

from dataclasses import dataclass

from simulator.capacity import ACTIVATION_RESERVE_BYTES, Capacity
from simulator.hardware import Hardware
from simulator.model_spec import ModelSpec


# The 2023 system the paper measured, outside the roofline: 10 ms a step and 1.5 ms a sequence (vLLM 0.1's Python
# scheduler, sampler and detokenizer). Fitted to one figure, vLLM batching 30.42 requests at 2 req/s on ShareGPT
# (OPT-13B, A100-40GB, Fig. 13a); tests/test_simulator.py checks the others against the paper.
PAPER_OVERHEADS = {"step_overhead_s": 0.010, "sequence_overhead_s": 0.0015}


@dataclass(frozen=True)
class CostModel:
    """`model` served on `tensor_parallel_size` devices of `hardware`.

    paging_overhead: attention through block tables reads the KV cache this much slower than a contiguous kernel
        (the paper's Fig. 18a: 20-26% in its kernel micro-benchmark); only paged systems pay it.
    step_overhead_s, sequence_overhead_s: the costs per step and per sequence in it, outside the roofline.
    """

    hardware: Hardware
    model: ModelSpec
    tensor_parallel_size: int = 1
    dtype_bytes: int = 2
    kv_dtype_bytes: int = 2
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = ACTIVATION_RESERVE_BYTES
    paging_overhead: float = 0.2
    step_overhead_s: float = 0.0
    sequence_overhead_s: float = 0.0
    kv_cache_memory_bytes: float | None = None  # a fixed KV budget, as the engine takes one on a CPU

    @property
    def weight_bytes(self) -> float:
        """Weights each device holds."""
        return self.model.num_params * self.dtype_bytes / self.tensor_parallel_size

    @property
    def kv_bytes_per_token(self) -> float:
        """One token's K and V on each device (its share of the KV heads)."""
        return self.model.kv_bytes_per_token(self.kv_dtype_bytes) / self.tensor_parallel_size

    @property
    def capacity(self) -> Capacity:
        """Each device's memory plan: the KV cache left beside the weights and the activations."""
        return Capacity(self.hardware.memory_bytes, self.gpu_memory_utilization, self.weight_bytes,
                        self.kv_bytes_per_token, activation_reserve_bytes=self.activation_reserve_bytes,
                        kv_cache_memory_bytes=self.kv_cache_memory_bytes)

    @property
    def kv_cache_tokens(self) -> int:
        return self.capacity.num_tokens

    def step_time(self, chunks: list[tuple[int, int]], paged: bool) -> float:
        """Seconds for one step computing, for each sequence, (tokens already computed, new tokens)."""
        model, tp = self.model, self.tensor_parallel_size
        new_tokens = sum(n for _, n in chunks)
        context = sum(c + n for c, n in chunks)  # keys each sequence's attention reads
        pairs = sum(n * c + n * (n + 1) // 2 for c, n in chunks)  # (query, key) pairs, causal within a chunk
        kv_read = context * self.kv_bytes_per_token * (1 + self.paging_overhead if paged else 1)
        read_time = (self.weight_bytes + kv_read) / self.hardware.memory_bandwidth
        flops = (2 * model.num_params * new_tokens + 4 * model.num_layers * model.hidden_size * pairs) / tp
        compute_time = flops / self.hardware.peak_flops
        return max(read_time, compute_time) + self.step_overhead_s + self.sequence_overhead_s * len(chunks)

    def swap_time(self, num_tokens: int) -> float:
        """Seconds to move `num_tokens` tokens' K and V between host and device."""
        return num_tokens * self.kv_bytes_per_token / self.hardware.pcie_bandwidth
