"""Phi-3 (Microsoft, 2024): Llama's layers with q, k and v stored as one matrix, and gate and up as one.

    x = embed(tokens)
    L x  x = x + attn(rms(x));  x = x + down(silu(gate(rms(x))) * up(rms(x)))
    -> rms -> lm_head

qkv_proj holds all q rows, then k, then v, and gate_up_proj the gate rows, then up: the layout the shared
pieces use already. The 128k-context variants' "longrope" scaling is not supported (a clear error).
"""

from jax_engine.model_config import ModelConfig
from jax_engine.models.architecture import Architecture, lm_head, special_token_fields
from jax_engine.models.layers import pre_norm_layer
from jax_engine.models.rope_scaling import rope_config_from_hf
from jax_engine.models.weights import WeightMap, hf


def config(c: dict) -> ModelConfig:
    theta, scaling = rope_config_from_hf(c)
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    return ModelConfig(
        architecture="phi3", vocab_size=c["vocab_size"], hidden_size=hidden,
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim, rope_theta=theta,
        rope_scaling=scaling, rotary_dim=int(head_dim * c["rope_parameters"].get("partial_rotary_factor", 1.0)),
        norm_eps=float(c["rms_norm_eps"]), max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=c["tie_word_embeddings"], hidden_act=c["hidden_act"],
        sliding_window=c.get("sliding_window"), **special_token_fields(c))


def weights(cfg: ModelConfig) -> WeightMap:
    layer = {
        "attn_norm": hf("input_layernorm.weight"), "w_qkv": hf("self_attn.qkv_proj.weight"),
        "w_o": hf("self_attn.o_proj.weight"), "mlp_norm": hf("post_attention_layernorm.weight"),
        "w_gate_up": hf("mlp.gate_up_proj.weight"), "w_down": hf("mlp.down_proj.weight"),
    }
    top = {"embed": hf("model.embed_tokens.weight"), "final_norm": hf("model.norm.weight"), **lm_head(cfg)}
    return WeightMap("model.layers.{i}.", layer, top)


PHI3 = Architecture("phi3", "Phi3ForCausalLM", config, weights, pre_norm_layer)
