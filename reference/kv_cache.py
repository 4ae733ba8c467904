"""The KV cache memory itself: per-layer key and value blocks on the device and on the host.

The block manager decides *which* blocks; this class holds their contents and performs the copies it
asks for (copy-on-write, swap out, swap in).
"""

import numpy as np


class KVCache:
    """K and V arrays of shape [num_layers, num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 num_host_blocks: int = 0, dtype=np.float32) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        host_shape = (num_layers, num_host_blocks, block_size, num_kv_heads, head_dim)
        self.k, self.v = np.zeros(shape, dtype), np.zeros(shape, dtype)
        self.host_k, self.host_v = np.zeros(host_shape, dtype), np.zeros(host_shape, dtype)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.k[:, dst], self.v[:, dst] = self.k[:, src], self.v[:, src]

    def swap_out(self, mapping: dict[int, int]) -> None:
        for device, host in mapping.items():
            self.host_k[:, host], self.host_v[:, host] = self.k[:, device], self.v[:, device]

    def swap_in(self, mapping: dict[int, int]) -> None:
        for host, device in mapping.items():
            self.k[:, device], self.v[:, device] = self.host_k[:, host], self.host_v[:, host]
