"""MPT (MosaicML, 2023): ALiBi, LayerNorms and matrices without biases.

    x = wte(tokens)
    L x  x = x + attn(norm_1(x));  x = x + ffn(norm_2(x))      (attention scores + ALiBi biases)
    -> norm_f -> logits (LM head tied to wte)

Wqkv holds all q rows, then k, then v.
"""

from jax_engine.model_config import ModelConfig
from jax_engine.models.alibi import mpt_slopes
from jax_engine.models.architecture import Architecture, lm_head, special_token_fields, unsupported
from jax_engine.models.layers import pre_norm_layer
from jax_engine.models.weights import WeightMap, hf


def config(c: dict) -> ModelConfig:
    attn = c["attn_config"]
    unsupported(attn, "clip_qkv", None, "clamped q/k/v", "config.json attn_config")
    unsupported(attn, "qk_ln", False, "LayerNorms on q and k", "config.json attn_config")
    hidden, heads = c["d_model"], c["n_heads"]
    return ModelConfig(
        architecture="mpt", vocab_size=c["vocab_size"], hidden_size=hidden,
        intermediate_size=4 * hidden,  # transformers' MptMLP is 4 x d_model, whatever expansion_ratio says
        num_layers=c["n_layers"], num_heads=heads,
        num_kv_heads=heads, head_dim=hidden // heads, rope_theta=0.0, norm_eps=c["layer_norm_epsilon"],
        max_position_embeddings=c["max_seq_len"], tie_word_embeddings=c["tie_word_embeddings"], norm="layer",
        hidden_act="gelu", gated_mlp=False, position_embedding="alibi",
        alibi_slopes=mpt_slopes(heads, attn["alibi_bias_max"]), softmax_scale=attn["softmax_scale"],
        **special_token_fields(c))


def weights(cfg: ModelConfig) -> WeightMap:
    layer = {
        "attn_norm": hf("norm_1.weight"), "attn_norm_bias": hf("norm_1.bias", optional=True),
        "w_qkv": hf("attn.Wqkv.weight"), "b_qkv": hf("attn.Wqkv.bias", optional=True),
        "w_o": hf("attn.out_proj.weight"), "b_o": hf("attn.out_proj.bias", optional=True),
        "mlp_norm": hf("norm_2.weight"), "mlp_norm_bias": hf("norm_2.bias", optional=True),
        "w_up": hf("ffn.up_proj.weight"), "b_up": hf("ffn.up_proj.bias", optional=True),
        "w_down": hf("ffn.down_proj.weight"), "b_down": hf("ffn.down_proj.bias", optional=True),
    }
    top = {"embed": hf("transformer.wte.weight"), "final_norm": hf("transformer.norm_f.weight"),
           "final_norm_bias": hf("transformer.norm_f.bias", optional=True), **lm_head(cfg)}
    return WeightMap("transformer.blocks.{i}.", layer, top)


MPT = Architecture("mpt", "MptForCausalLM", config, weights, pre_norm_layer)
