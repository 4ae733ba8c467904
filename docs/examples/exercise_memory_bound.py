"""Answers to page 1's exercises, from the reference's own objects."""

from types import SimpleNamespace

import numpy as np

from reference import KVCache, LlamaModel, ReferenceEngine, SamplingParams

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
cfg = SimpleNamespace(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=8, rope_theta=10000.0, norm_eps=1e-6,
                      tie_word_embeddings=True)
rng = np.random.default_rng(0)
shapes = {"self_attn.q_proj": (16, 16), "self_attn.k_proj": (8, 16),
          "self_attn.v_proj": (8, 16), "self_attn.o_proj": (16, 16),
          "mlp.gate_proj": (32, 16), "mlp.up_proj": (32, 16), "mlp.down_proj": (16, 32)}
weights = {"model.embed_tokens.weight": rng.standard_normal((64, 16)),
           "model.norm.weight": np.ones(16)}
for layer in range(cfg.num_layers):
    prefix = f"model.layers.{layer}."
    weights |= {prefix + name + ".weight": rng.standard_normal(shape) * 0.3
                for name, shape in shapes.items()}
    weights |= {prefix + "input_layernorm.weight": np.ones(16),
                prefix + "post_attention_layernorm.weight": np.ones(16)}
engine = ReferenceEngine(LlamaModel(cfg, weights), num_blocks=8, block_size=4)
engine.generate([[1, 2, 3, 4, 5], [6, 7, 8]],
                SamplingParams(temperature=0, max_tokens=3))
computed = [sum(s.num_new_tokens for s in out.scheduled) for out in engine.trace]
print(f"3. {len(engine.trace)} steps; tokens computed per step: {computed}")
