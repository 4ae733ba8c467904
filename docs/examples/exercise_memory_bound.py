"""Answers to page 1's exercises, from the reference's own objects."""

import numpy as np

from reference import KVCache, ReferenceEngine, SamplingParams
from reference.tutorial.tiny_llama import tiny_llama

# 1. SmolLM2 without grouped-query attention (9 KV heads, one per query head),
#    cache in float16: how many bytes of K/V per token?
cache = KVCache(num_layers=30, num_blocks=1, block_size=16, num_kv_heads=9,
                head_dim=64, dtype=np.float16)
print(f"1. {(cache.k.nbytes + cache.v.nbytes) // 16:,} bytes per token")

# 2. At a context of 512 tokens, from what batch size on does a decode step
#    read more bytes of K/V than of weights (538,060,032 bytes, SmolLM2 float32)?
weight_bytes, kv_bytes_per_token, context = 538_060_032, 46_080, 512
batch = next(b for b in range(1, 1000)
             if b * context * kv_bytes_per_token > weight_bytes)
print(f"2. from batch {batch} on")

# 3. A tiny model; prompts of 5 and 3 tokens arrive together, 3 new tokens each.
#    How many steps run, and how many tokens does each step compute?
engine = ReferenceEngine(tiny_llama(), num_blocks=8, block_size=4)
engine.generate([[1, 2, 3, 4, 5], [6, 7, 8]],
                SamplingParams(temperature=0, max_tokens=3))
computed = [sum(s.num_new_tokens for s in out.scheduled) for out in engine.trace]
print(f"3. {len(engine.trace)} steps; tokens computed per step: {computed}")
