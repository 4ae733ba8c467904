"""Helpers that run the reference model on one sequence through a shuffled paged cache."""

import numpy as np

from reference import AttentionMetadata, KVCache, LlamaModel


def paged_logits(model: LlamaModel, token_ids: list[int], chunk_sizes: list[int], block_size: int = 4,
                 seed: int = 0) -> np.ndarray:
    """Logits of every position, computed chunk by chunk; later chunks read earlier ones from the cache.

    The block table is a random permutation, so the test also covers non-contiguous blocks.
    """
    cfg = model.config
    num_blocks = -(-len(token_ids) // block_size) + 2
    cache = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    table = [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)]
    logits, start = [], 0
    for size in chunk_sizes:
        positions = np.arange(start, start + size)
        slots = np.array([table[p // block_size] * block_size + p % block_size for p in positions])
        metadata = AttentionMetadata(slots, np.array([0, size]), np.array([start + size]), [table])
        logits.append(model.forward(np.array(token_ids[start : start + size]), positions, cache, metadata))
        start += size
    assert start == len(token_ids), "chunk sizes must add up to the sequence length"
    return np.concatenate(logits)
