"""GPT-NeoX (EleutherAI, 2022; Pythia, StableLM-alpha, Dolly): parallel residual, partial rotary embeddings.

    x = embed_in(tokens)
    L x  x = x + attn(ln_in(x)) + mlp(ln_post(x))         (use_parallel_residual, the default)
         x = x + attn(ln_in(x));  x = x + mlp(ln_post(x)) (otherwise)
    -> final LN -> embed_out (an LM head of its own)

RoPE (rotate-half) turns only the first rotary_pct of each head's features. The fused query_key_value
matrix holds, per head, that head's q, k and v rows together (models/weights.ungroup_qkv).
"""

from functools import partial

from jax_engine.model_config import ModelConfig
from jax_engine.models.architecture import Architecture, lm_head, special_token_fields
from jax_engine.models.layers import mlp, norm, self_attention
from jax_engine.models.rope_scaling import rope_config_from_hf
from jax_engine.models.weights import WeightMap, derived, hf, ungroup_qkv


def config(c: dict) -> ModelConfig:
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    theta, scaling = rope_config_from_hf(c)
    head_dim = hidden // heads
    return ModelConfig(
        architecture="gpt_neox", vocab_size=c["vocab_size"], hidden_size=hidden,
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=heads, head_dim=head_dim, rope_theta=theta, rope_scaling=scaling,
        rotary_dim=int(head_dim * c["rope_parameters"].get("partial_rotary_factor", 1.0)),
        norm_eps=c["layer_norm_eps"], max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=c["tie_word_embeddings"], norm="layer", hidden_act=c["hidden_act"], gated_mlp=False,
        parallel_residual=c["use_parallel_residual"], **special_token_fields(c))


def weights(cfg: ModelConfig) -> WeightMap:
    per_head = partial(ungroup_qkv, num_kv_heads=cfg.num_heads, head_dim=cfg.head_dim)
    layer = {
        "attn_norm": hf("input_layernorm.weight"), "attn_norm_bias": hf("input_layernorm.bias"),
        "w_qkv": derived(per_head, "attention.query_key_value.weight"),
        "b_qkv": derived(per_head, "attention.query_key_value.bias", optional=True),
        "w_o": hf("attention.dense.weight"), "b_o": hf("attention.dense.bias", optional=True),
        "mlp_norm": hf("post_attention_layernorm.weight"), "mlp_norm_bias": hf("post_attention_layernorm.bias"),
        "w_up": hf("mlp.dense_h_to_4h.weight"), "b_up": hf("mlp.dense_h_to_4h.bias"),
        "w_down": hf("mlp.dense_4h_to_h.weight"), "b_down": hf("mlp.dense_4h_to_h.bias"),
    }
    top = {"embed": hf("gpt_neox.embed_in.weight"), "final_norm": hf("gpt_neox.final_layer_norm.weight"),
           "final_norm_bias": hf("gpt_neox.final_layer_norm.bias"), **lm_head(cfg, "embed_out.weight")}
    return WeightMap("gpt_neox.layers.{i}.", layer, top)


def layer(cfg: ModelConfig, w: dict, i, x, ctx):
    attn = self_attention(cfg, w, i, norm(cfg, w, "attn_norm", i, x), ctx)
    if cfg.parallel_residual:
        return x + attn + mlp(cfg, w, i, norm(cfg, w, "mlp_norm", i, x), ctx)
    x = x + attn
    return x + mlp(cfg, w, i, norm(cfg, w, "mlp_norm", i, x), ctx)


GPT_NEOX = Architecture("gpt_neox", "GPTNeoXForCausalLM", config, weights, layer)
