"""OPT (Meta, 2022; vLLM's quick-start model facebook/opt-125m): learned positions, LayerNorm, ReLU MLP.

    x = embed(tokens) [-> project_in] + positions[p + 2]
    L x  x = x + attn(LN(x));  x = x + fc2(relu(fc1(LN(x))))        (pre-norm, every OPT but 350m)
         x = LN(x + attn(x));  x = LN(x + fc2(relu(fc1(x))))        (post-norm: do_layer_norm_before=false)
    -> final LN (pre-norm only) [-> project_out] -> logits (LM head tied to the embedding)

OPT-350m embeds in 512 dimensions (word_embed_proj_dim) and projects in and out of its 1024-wide layers.
"""

from jax_engine.model_config import ModelConfig
from jax_engine.models.architecture import Architecture, lm_head, special_token_fields, unsupported
from jax_engine.models.layers import mlp, norm, pre_norm_layer, self_attention
from jax_engine.models.weights import WeightMap, hf

# OPT's position table has two extra rows at the start (fairseq's padding offset).
POSITION_OFFSET = 2


def config(hf_config: dict) -> ModelConfig:
    c = hf_config
    unsupported(c, "layer_norm_elementwise_affine", True, "LayerNorms without weights")
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    return ModelConfig(
        architecture="opt", vocab_size=c["vocab_size"], hidden_size=hidden, intermediate_size=c["ffn_dim"],
        num_layers=c["num_hidden_layers"], num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        rope_theta=0.0, norm_eps=1e-5, max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=c["tie_word_embeddings"], norm="layer", hidden_act=c["activation_function"],
        gated_mlp=False, position_embedding="learned", position_offset=POSITION_OFFSET,
        embedding_size=c["word_embed_proj_dim"], norm_before=c["do_layer_norm_before"], **special_token_fields(c))


def weights(cfg: ModelConfig) -> WeightMap:
    layer = {
        "attn_norm": hf("self_attn_layer_norm.weight"), "attn_norm_bias": hf("self_attn_layer_norm.bias"),
        "w_qkv": hf("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "b_qkv": hf("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", optional=True),
        "w_o": hf("self_attn.out_proj.weight"), "b_o": hf("self_attn.out_proj.bias", optional=True),
        "mlp_norm": hf("final_layer_norm.weight"), "mlp_norm_bias": hf("final_layer_norm.bias"),
        "w_up": hf("fc1.weight"), "b_up": hf("fc1.bias", optional=True),
        "w_down": hf("fc2.weight"), "b_down": hf("fc2.bias", optional=True),
    }
    top = {
        "embed": hf("model.decoder.embed_tokens.weight"), "positions": hf("model.decoder.embed_positions.weight"),
        "project_in": hf("model.decoder.project_in.weight", optional=True),
        "project_out": hf("model.decoder.project_out.weight", optional=True),
        "final_norm": hf("model.decoder.final_layer_norm.weight", optional=True),
        "final_norm_bias": hf("model.decoder.final_layer_norm.bias", optional=True),
        **lm_head(cfg),
    }
    return WeightMap("model.decoder.layers.{i}.", layer, top)


def layer(cfg: ModelConfig, w: dict, i, x, ctx):
    if cfg.norm_before:
        return pre_norm_layer(cfg, w, i, x, ctx)
    x = norm(cfg, w, "attn_norm", i, x + self_attention(cfg, w, i, x, ctx))
    return norm(cfg, w, "mlp_norm", i, x + mlp(cfg, w, i, x, ctx))


OPT = Architecture("opt", "OPTForCausalLM", config, weights, layer)
