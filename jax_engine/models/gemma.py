"""Gemma (Google, 2024): Llama's layers with a GELU-gated MLP, embeddings scaled by sqrt(hidden), and
RMSNorms that multiply by (1 + weight).

    x = embed(tokens) * sqrt(H)
    L x  x = x + attn(rms(x));  x = x + down(gelu(gate(rms(x))) * up(rms(x)))
    -> rms -> logits (LM head tied to the embedding)

The norms' (1 + weight) is added once, at load time, so the shared RMSNorm serves Gemma too.
"""

import math

from jax_engine.model_config import ModelConfig
from jax_engine.models.architecture import Architecture, lm_head, special_token_fields
from jax_engine.models.layers import pre_norm_layer
from jax_engine.models.rope_scaling import rope_config_from_hf
from jax_engine.models.weights import WeightMap, derived, hf


def config(c: dict) -> ModelConfig:
    theta, scaling = rope_config_from_hf(c)
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    return ModelConfig(
        architecture="gemma", vocab_size=c["vocab_size"], hidden_size=hidden,
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=c["head_dim"], rope_theta=theta,
        rope_scaling=scaling, norm_eps=float(c["rms_norm_eps"]), max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=c["tie_word_embeddings"], hidden_act=c["hidden_act"],
        embedding_multiplier=math.sqrt(hidden), **special_token_fields(c))


def plus_one(name: str):
    return derived(lambda w: w + 1.0, name)


def weights(cfg: ModelConfig) -> WeightMap:
    layer = {
        "attn_norm": plus_one("input_layernorm.weight"),
        "w_qkv": hf("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "w_o": hf("self_attn.o_proj.weight"), "mlp_norm": plus_one("post_attention_layernorm.weight"),
        "w_gate_up": hf("mlp.gate_proj.weight", "mlp.up_proj.weight"), "w_down": hf("mlp.down_proj.weight"),
    }
    top = {"embed": hf("model.embed_tokens.weight"), "final_norm": plus_one("model.norm.weight"), **lm_head(cfg)}
    return WeightMap("model.layers.{i}.", layer, top)


GEMMA = Architecture("gemma", "GemmaForCausalLM", config, weights, pre_norm_layer)
