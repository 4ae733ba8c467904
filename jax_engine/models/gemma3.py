"""Gemma 3 (Google, 2025), text: Gemma's layers with four norms each, q/k norms, and two kinds of layers.

    x = embed(tokens) * sqrt(H)
    L x  x = x + rms(attn(rms(x)));  x = x + rms(down(gelu(gate(rms(x))) * up(rms(x))))
    -> rms -> logits (LM head tied to the embedding)

Most layers are local: they attend to their last `sliding_window` tokens and rotate by their own RoPE base
(`rope_local_base_freq`, 10,000); every sixth (config.json's `layer_types`) is global: all tokens, RoPE base
`rope_theta` (1,000,000, scaled in the larger models). Both kinds run in the one layer scan, each layer's window
and RoPE tables picked by its index (CausalLM's `_per_layer`). q and k are RMS-normalised per head before RoPE,
and the scores are scaled by `query_pre_attn_scalar`^-1/2. Every norm multiplies by (1 + weight), added once at
load time as in Gemma.
"""

import math

from jax_engine.model_config import ModelConfig
from jax_engine.models.architecture import Architecture, lm_head, special_token_fields, unsupported
from jax_engine.models.gemma import plus_one
from jax_engine.models.layers import StepContext, mlp, norm, self_attention
from jax_engine.models.rope import rope_config_from_hf
from jax_engine.models.weights import WeightMap, hf

LAYER_KINDS = ("sliding_attention", "full_attention")


def _rope(c: dict) -> tuple[float, object, float]:
    """(global theta, global scaling, local theta), from transformers 5's rope_parameters per layer kind or the
    older rope_theta / rope_scaling / rope_local_base_freq."""
    params = c.get("rope_parameters") or {}
    if "full_attention" in params:
        theta, scaling = rope_config_from_hf({**c, "rope_scaling": None, "rope_parameters": params["full_attention"]})
        local, local_scaling = rope_config_from_hf({**c, "rope_scaling": None,
                                                    "rope_parameters": params.get("sliding_attention") or {}})
        if local_scaling is not None:
            raise ValueError("config.json: rope_parameters['sliding_attention'] must be unscaled (rope_type "
                             "'default'), as Gemma 3's are")
        return theta, scaling, local
    theta, scaling = rope_config_from_hf(c)
    return theta, scaling, float(c.get("rope_local_base_freq", 10000.0))


def config(c: dict) -> ModelConfig:
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        unsupported(c, field, None, "Gemma 2's soft-capping")
    unsupported(c, "use_bidirectional_attention", False, "EmbeddingGemma's bidirectional attention")
    kinds = c["layer_types"]
    if set(kinds) - set(LAYER_KINDS) or len(kinds) != c["num_hidden_layers"]:
        raise ValueError(f"config.json: layer_types must give one of {LAYER_KINDS} per layer, got {kinds}")
    theta, scaling, local_theta = _rope(c)
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    return ModelConfig(
        architecture="gemma3_text", vocab_size=c["vocab_size"], hidden_size=hidden,
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=c["head_dim"], rope_theta=theta,
        rope_scaling=scaling, norm_eps=float(c["rms_norm_eps"]), max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=c["tie_word_embeddings"], hidden_act=c["hidden_activation"],
        embedding_multiplier=math.sqrt(hidden), softmax_scale=c["query_pre_attn_scalar"] ** -0.5,
        sliding_window=c["sliding_window"], sliding_window_layers=tuple(k == "sliding_attention" for k in kinds),
        rope_local_theta=local_theta, **special_token_fields(c))


def weights(cfg: ModelConfig) -> WeightMap:
    layer = {
        "attn_norm": plus_one("input_layernorm.weight"),
        "w_qkv": hf("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "q_norm": plus_one("self_attn.q_norm.weight"), "k_norm": plus_one("self_attn.k_norm.weight"),
        "w_o": hf("self_attn.o_proj.weight"), "post_attn_norm": plus_one("post_attention_layernorm.weight"),
        "mlp_norm": plus_one("pre_feedforward_layernorm.weight"),
        "w_gate_up": hf("mlp.gate_proj.weight", "mlp.up_proj.weight"), "w_down": hf("mlp.down_proj.weight"),
        "post_mlp_norm": plus_one("post_feedforward_layernorm.weight"),
    }
    top = {"embed": hf("model.embed_tokens.weight"), "final_norm": plus_one("model.norm.weight"), **lm_head(cfg)}
    return WeightMap("model.layers.{i}.", layer, top)


def gemma3_layer(cfg: ModelConfig, w: dict, layer, x, ctx: StepContext):
    """Each block's output is normalised again before it joins the residual stream."""
    x = x + norm(cfg, w, "post_attn_norm", layer, self_attention(cfg, w, layer, norm(cfg, w, "attn_norm", layer, x),
                                                                 ctx))
    return x + norm(cfg, w, "post_mlp_norm", layer, mlp(cfg, w, layer, norm(cfg, w, "mlp_norm", layer, x), ctx))


GEMMA3 = Architecture("gemma3_text", "Gemma3ForCausalLM", config, weights, gemma3_layer)
