"""BLOOM (BigScience, 2022): ALiBi instead of position embeddings, a LayerNorm on the embeddings.

    x = LN_emb(word_embeddings(tokens))
    L x  x = x + attn(ln_in(x));  x = x + mlp(ln_post(x))      (attention scores + ALiBi biases)
    -> ln_f -> logits (LM head tied to the embedding)

The fused query_key_value matrix holds, per head, that head's q, k and v rows together.
"""

from functools import partial

from jax_engine.model_config import ModelConfig
from jax_engine.models.alibi import bloom_slopes
from jax_engine.models.architecture import Architecture, lm_head, special_token_fields, unsupported
from jax_engine.models.layers import pre_norm_layer
from jax_engine.models.weights import WeightMap, derived, hf, ungroup_qkv

# ALiBi has no position table; vLLM serves such models up to 2048 tokens unless told otherwise.
DEFAULT_MAX_LEN = 2048


def config(c: dict) -> ModelConfig:
    unsupported(c, "apply_residual_connection_post_layernorm", False, "residuals taken after the LayerNorm")
    hidden, heads = c["hidden_size"], c["n_head"]
    return ModelConfig(
        architecture="bloom", vocab_size=c["vocab_size"], hidden_size=hidden, intermediate_size=4 * hidden,
        num_layers=c["n_layer"], num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, rope_theta=0.0,
        norm_eps=c["layer_norm_epsilon"], max_position_embeddings=c.get("seq_length") or DEFAULT_MAX_LEN,
        tie_word_embeddings=c["tie_word_embeddings"], norm="layer", hidden_act="gelu_new", gated_mlp=False,
        position_embedding="alibi", alibi_slopes=bloom_slopes(heads), **special_token_fields(c))


def weights(cfg: ModelConfig) -> WeightMap:
    per_head = partial(ungroup_qkv, num_kv_heads=cfg.num_heads, head_dim=cfg.head_dim)
    layer = {
        "attn_norm": hf("input_layernorm.weight"), "attn_norm_bias": hf("input_layernorm.bias"),
        "w_qkv": derived(per_head, "self_attention.query_key_value.weight"),
        "b_qkv": derived(per_head, "self_attention.query_key_value.bias"),
        "w_o": hf("self_attention.dense.weight"), "b_o": hf("self_attention.dense.bias"),
        "mlp_norm": hf("post_attention_layernorm.weight"), "mlp_norm_bias": hf("post_attention_layernorm.bias"),
        "w_up": hf("mlp.dense_h_to_4h.weight"), "b_up": hf("mlp.dense_h_to_4h.bias"),
        "w_down": hf("mlp.dense_4h_to_h.weight"), "b_down": hf("mlp.dense_4h_to_h.bias"),
    }
    top = {"embed": hf("transformer.word_embeddings.weight"),
           "embed_norm": hf("transformer.word_embeddings_layernorm.weight"),
           "embed_norm_bias": hf("transformer.word_embeddings_layernorm.bias"),
           "final_norm": hf("transformer.ln_f.weight"), "final_norm_bias": hf("transformer.ln_f.bias"), **lm_head(cfg)}
    return WeightMap("transformer.h.{i}.", layer, top)


BLOOM = Architecture("bloom", "BloomForCausalLM", config, weights, pre_norm_layer)
