"""Llama (Meta, 2023) and the families built from the same layers: SmolLM2 (the default model) is a Llama,
Mistral adds a sliding window, Qwen2 biases on q, k and v, Qwen3 an RMSNorm on each query and key head.

    x = embed(tokens)
    L x  x = x + attn(rms(x))                       (RoPE; grouped-query attention)
         x = x + down(silu(gate(rms(x))) * up(rms(x)))
    -> rms -> logits (LM head, or the embedding when tied)
"""

from jax_engine.model_config import ModelConfig
from jax_engine.models.architecture import Architecture, lm_head, special_token_fields, unsupported
from jax_engine.models.layers import pre_norm_layer
from jax_engine.models.rope_scaling import rope_config_from_hf
from jax_engine.models.weights import WeightMap, hf


def config(c: dict) -> ModelConfig:
    # Qwen's windows apply from layer max_window_layers on, a window per layer, which no release enables.
    unsupported(c, "use_sliding_window", False, "Qwen's sliding windows on some layers only")
    theta, scaling = rope_config_from_hf(c)
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    return ModelConfig(
        architecture=c["model_type"], vocab_size=c["vocab_size"], hidden_size=hidden,
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or hidden // heads,
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(c["rms_norm_eps"]),
        max_position_embeddings=c["max_position_embeddings"], tie_word_embeddings=c["tie_word_embeddings"],
        hidden_act=c.get("hidden_act", "silu"),
        sliding_window=c.get("sliding_window") if c["model_type"] == "mistral" else None,
        **special_token_fields(c))


def weights(cfg: ModelConfig) -> WeightMap:
    layer = {
        "attn_norm": hf("input_layernorm.weight"),
        "w_qkv": hf("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "b_qkv": hf("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", optional=True),
        "q_norm": hf("self_attn.q_norm.weight", optional=True), "k_norm": hf("self_attn.k_norm.weight", optional=True),
        "w_o": hf("self_attn.o_proj.weight"), "b_o": hf("self_attn.o_proj.bias", optional=True),
        "mlp_norm": hf("post_attention_layernorm.weight"),
        "w_gate_up": hf("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "b_gate_up": hf("mlp.gate_proj.bias", "mlp.up_proj.bias", optional=True),
        "w_down": hf("mlp.down_proj.weight"), "b_down": hf("mlp.down_proj.bias", optional=True),
    }
    top = {"embed": hf("model.embed_tokens.weight"), "final_norm": hf("model.norm.weight"), **lm_head(cfg)}
    return WeightMap("model.layers.{i}.", layer, top)


LLAMA, MISTRAL, QWEN2, QWEN3 = (Architecture(name, hf_class, config, weights, pre_norm_layer) for name, hf_class in (
    ("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM")))
