"""How long a step takes: a roofline over the weights, the KV cache a step attends over, and its FLOPs.

A decoding step reads every weight once whatever the batch, and each sequence's K and V once per layer; it
computes 2 FLOPs per parameter per token, and 4 per layer per head dimension per (query, key) pair in attention.
Whichever of reading and computing takes longer sets the step's time (they overlap on a GPU), plus fixed costs
per step (scheduling, kernel launches) and per sequence in the step (sampling, detokenizing, bookkeeping), which
the roofline cannot see.
"""

from dataclasses import dataclass

from simulator.capacity import ACTIVATION_RESERVE_BYTES, GiB, Capacity
from simulator.hardware import Hardware, hardware
from simulator.model_spec import ModelSpec, model_spec

# The 2023 system the paper measured, outside the roofline: 20 ms a step (vLLM 0.1's Python scheduler, input
# preparation, sampler and detokenizer, and its kernel launches without CUDA graphs). Fitted to one figure, vLLM
# batching 30.42 requests at 2 req/s over a 1-hour ShareGPT trace (OPT-13B, A100-40GB, Fig. 13a);
# tests/test_simulator.py checks the others against the paper. Nothing is charged per sequence: the roofline
# already reads each sequence's K and V.
PAPER_OVERHEADS = {"step_overhead_s": 0.020, "sequence_overhead_s": 0.0}
# The paper's servers (its Table 1): model -> (GPU, how many, KV cache memory over all of them).
PAPER_SERVERS = {"opt-13b": ("a100-40gb", 1, 12 * GiB), "opt-66b": ("a100-40gb", 4, 21 * GiB),
                 "opt-175b": ("a100-80gb", 8, 264 * GiB)}


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

    def swap_time(self, num_blocks: int, block_size: int) -> float:
        """Seconds to move `num_blocks` blocks of K and V between host and device. vLLM copies block by block,
        layer by layer, K apart from V (its cache engine's swap_blocks): 2 x layers copies a block, each paying
        the hardware's cost per copy beside its bytes over PCIe."""
        num_bytes = num_blocks * block_size * self.kv_bytes_per_token
        num_copies = num_blocks * 2 * self.model.num_layers
        return num_bytes / self.hardware.pcie_bandwidth + num_copies * self.hardware.copy_latency_s


def paper_cost_model(model: str = "opt-13b") -> CostModel:
    """`model` on the paper's server for it (Table 1: its GPUs, and their KV cache memory, 12 GB for OPT-13B:
    15.7k tokens), with the paper's overheads."""
    device, tensor_parallel_size, kv_cache_bytes = PAPER_SERVERS[model]
    return CostModel(hardware(device), model_spec(model), tensor_parallel_size,
                     kv_cache_memory_bytes=kv_cache_bytes / tensor_parallel_size, **PAPER_OVERHEADS)
