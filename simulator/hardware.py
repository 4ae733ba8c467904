"""Accelerators from their public spec sheets: what the cost model needs to know about each."""

from dataclasses import dataclass

GB = 1e9
GiB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    """One device. Bandwidths in bytes/s, FLOPs in FLOP/s (dense half precision, no sparsity)."""

    name: str
    memory_bytes: float  # NVIDIA's "40GB" is 40 GiB of HBM
    memory_bandwidth: float
    peak_flops: float
    pcie_bandwidth: float  # host <-> device, for swapping
    # Each host <-> device copy call costs this much beyond its bytes: cudaMemcpyAsync's overhead per call, measured
    # at 5-7 us for small copies (DualPath, arXiv 2602.21548, Section 5.2). It is why small blocks swap slowly.
    copy_latency_s: float = 5e-6


# NVIDIA's data sheets: A100 (40 GB PCIe/SXM: 1,555 GB/s; 80 GB SXM: 2,039 GB/s; 312 TFLOPS FP16 tensor), H100 SXM
# (3.35 TB/s, 989 TFLOPS FP16 tensor), L4 (300 GB/s, 121 TFLOPS FP16 tensor). PCIe 4.0 x16 moves 32 GB/s each way
# in theory and about 25 in practice; PCIe 5.0 twice that.
PRESETS = {
    "a100-40gb": Hardware("a100-40gb", 40 * GiB, 1555 * GB, 312e12, 25 * GB),
    "a100-80gb": Hardware("a100-80gb", 80 * GiB, 2039 * GB, 312e12, 25 * GB),
    "h100-80gb": Hardware("h100-80gb", 80 * GiB, 3350 * GB, 989e12, 50 * GB),
    "l4": Hardware("l4", 24 * GiB, 300 * GB, 121e12, 25 * GB),
}


def hardware(name: str) -> Hardware:
    """A preset by name; ValueError listing the presets for an unknown one."""
    if name not in PRESETS:
        raise ValueError(f"hardware must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]
