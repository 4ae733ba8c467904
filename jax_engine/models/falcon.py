"""Falcon (TII, 2023): attention and MLP side by side, multi-query or grouped-query attention.

    x = word_embeddings(tokens)
    L x  x = x + attn(ln_attn(x)) + mlp(ln_mlp(x))        new decoder layout (40B, 180B): two norms
         x = x + attn(ln(x)) + mlp(ln(x))                 parallel_attn (7B): one norm for both
         x = x + attn(ln(x));  x = x + mlp(ln_post(x))    otherwise
    -> ln_f -> logits (LM head tied to the embedding)

RoPE by default; the RefinedWeb models (alibi=true) use ALiBi, which Falcon adds before the 1/sqrt(D) scale,
so its slopes are scaled down by sqrt(D). The fused query_key_value rows: q heads then one k and one v head
per KV group in the new layout (models/weights.ungroup_qkv), per head (q, k, v) without MQA in the old one,
all q then k then v with MQA.
"""

from functools import partial

from jax_engine.model_config import ModelConfig
from jax_engine.models.alibi import bloom_slopes
from jax_engine.models.architecture import Architecture, lm_head, special_token_fields
from jax_engine.models.layers import mlp, norm, self_attention
from jax_engine.models.rope_scaling import rope_config_from_hf
from jax_engine.models.weights import WeightMap, derived, first_of, hf, ungroup_qkv


def config(c: dict) -> ModelConfig:
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = hidden // heads
    new_layout = c["new_decoder_architecture"]
    kv_heads = c["num_kv_heads"] if new_layout else 1 if c["multi_query"] else heads
    theta, scaling = rope_config_from_hf(c)
    alibi = c["alibi"]
    return ModelConfig(
        architecture="falcon", vocab_size=c["vocab_size"], hidden_size=hidden,
        intermediate_size=c["ffn_hidden_size"] or 4 * hidden, num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta, rope_scaling=scaling,
        norm_eps=c["layer_norm_epsilon"], max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=c["tie_word_embeddings"], norm="layer", hidden_act=c["activation"], gated_mlp=False,
        position_embedding="alibi" if alibi else "rope",
        alibi_slopes=tuple(s * head_dim**-0.5 for s in bloom_slopes(heads)) if alibi else None,
        parallel_residual=new_layout or c["parallel_attn"], **special_token_fields(c))


def weights(cfg: ModelConfig) -> WeightMap:
    # Per KV group (new layout, or one group per head without MQA); MQA's old layout is q, k, v already.
    grouped = cfg.num_kv_heads > 1
    qkv = partial(ungroup_qkv, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim) if grouped else (lambda w: w)
    layer = {
        # The new layout names its two norms ln_attn / ln_mlp; the others have input_layernorm (and, when not
        # parallel, post_attention_layernorm).
        "attn_norm": first_of("ln_attn.weight", "input_layernorm.weight"),
        "attn_norm_bias": first_of("ln_attn.bias", "input_layernorm.bias"),
        "mlp_norm": first_of("ln_mlp.weight", "post_attention_layernorm.weight", optional=True),
        "mlp_norm_bias": first_of("ln_mlp.bias", "post_attention_layernorm.bias", optional=True),
        "w_qkv": derived(qkv, "self_attention.query_key_value.weight"),
        "b_qkv": derived(qkv, "self_attention.query_key_value.bias", optional=True),
        "w_o": hf("self_attention.dense.weight"), "b_o": hf("self_attention.dense.bias", optional=True),
        "w_up": hf("mlp.dense_h_to_4h.weight"), "b_up": hf("mlp.dense_h_to_4h.bias", optional=True),
        "w_down": hf("mlp.dense_4h_to_h.weight"), "b_down": hf("mlp.dense_4h_to_h.bias", optional=True),
    }
    top = {"embed": hf("transformer.word_embeddings.weight"), "final_norm": hf("transformer.ln_f.weight"),
           "final_norm_bias": hf("transformer.ln_f.bias"), **lm_head(cfg)}
    return WeightMap("transformer.h.{i}.", layer, top)


def layer(cfg: ModelConfig, w: dict, i, x, ctx):
    h = norm(cfg, w, "attn_norm", i, x)
    attn = self_attention(cfg, w, i, h, ctx)
    if not cfg.parallel_residual:
        x = x + attn
        return x + mlp(cfg, w, i, norm(cfg, w, "mlp_norm", i, x), ctx)
    h_mlp = norm(cfg, w, "mlp_norm", i, x) if "mlp_norm" in w else h
    return x + attn + mlp(cfg, w, i, h_mlp, ctx)


FALCON = Architecture("falcon", "FalconForCausalLM", config, weights, layer)
