"""A tiny random Llama for the tutorial's examples: the real LlamaModel on weights small enough to read."""

from types import SimpleNamespace

import numpy as np

from reference.llama import LlamaModel

SHAPES = {"self_attn.q_proj": (16, 16), "self_attn.k_proj": (8, 16),  # [out, in]
          "self_attn.v_proj": (8, 16), "self_attn.o_proj": (16, 16),
          "mlp.gate_proj": (32, 16), "mlp.up_proj": (32, 16), "mlp.down_proj": (16, 32)}


def tiny_llama() -> LlamaModel:
    """2 layers, 4 query heads over 2 KV heads of dim 4, a 32-token vocabulary."""
    cfg = SimpleNamespace(vocab_size=32, hidden_size=16, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=4, rope_theta=10000.0,
                          norm_eps=1e-6, tie_word_embeddings=True)
    rng = np.random.default_rng(0)
    weights = {"model.embed_tokens.weight": rng.normal(size=(32, 16)),
               "model.norm.weight": np.ones(16)}
    for layer in range(cfg.num_layers):
        for name, shape in SHAPES.items():
            weights[f"model.layers.{layer}.{name}.weight"] = rng.normal(size=shape)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{layer}.{norm}.weight"] = np.ones(16)
    return LlamaModel(cfg, {k: v.astype(np.float32) for k, v in weights.items()})
