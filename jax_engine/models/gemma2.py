"""Gemma 2 (Google, 2024): Gemma's layers with a norm after each block too, two kinds of layers, soft caps.

    x = embed(tokens) * sqrt(H)
    L x  x = x + rms(attn(rms(x)));  x = x + rms(down(gelu(gate(rms(x))) * up(rms(x))))
    -> rms -> logits -> cap * tanh(logits / cap)          (LM head tied to the embedding)

Every other layer is local (config.json's `layer_types`; the first is): it attends to its last `sliding_window`
tokens; the others see every token. Scores are scaled by `query_pre_attn_scalar`^-1/2 and soft-capped,
cap * tanh(score / cap) with cap `attn_logit_softcapping` (50), before the softmax; the final logits likewise
with `final_logit_softcapping` (30). Every norm multiplies by (1 + weight), added once at load time as in Gemma.
Gemma 3 (gemma3.py) keeps this layer and adds q/k norms and a RoPE base of its own for the local layers.
"""

import math

from jax_engine.model_config import ModelConfig
from jax_engine.models.architecture import Architecture, lm_head, special_token_fields, unsupported
from jax_engine.models.gemma import plus_one
from jax_engine.models.layers import StepContext, mlp, norm, self_attention
from jax_engine.models.rope_scaling import rope_config_from_hf
from jax_engine.models.weights import WeightMap, hf

LAYER_KINDS = ("sliding_attention", "full_attention")


def windowed_layers(c: dict) -> tuple[bool, ...]:
    """Which layers attend through the sliding window: config.json's `layer_types` (transformers' default for
    Gemma 2 when it is absent: every other layer, the first included)."""
    kinds = c.get("layer_types") or [LAYER_KINDS[i % 2] for i in range(c["num_hidden_layers"])]
    if set(kinds) - set(LAYER_KINDS) or len(kinds) != c["num_hidden_layers"]:
        raise ValueError(f"config.json: layer_types must give one of {LAYER_KINDS} per layer, got {kinds}")
    return tuple(k == "sliding_attention" for k in kinds)


def gemma2_family_fields(c: dict) -> dict:
    """The ModelConfig fields Gemma 2 and 3 read alike."""
    if c.get("use_bidirectional_attention"):  # Gemma 2's config leaves it None, Gemma 3's False
        unsupported(c, "use_bidirectional_attention", False, "EmbeddingGemma's bidirectional attention")
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    return dict(
        vocab_size=c["vocab_size"], hidden_size=hidden, intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"], num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c["head_dim"], norm_eps=float(c["rms_norm_eps"]), max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=c["tie_word_embeddings"], hidden_act=c.get("hidden_activation") or c["hidden_act"],
        embedding_multiplier=math.sqrt(hidden), softmax_scale=c["query_pre_attn_scalar"] ** -0.5,
        sliding_window=c["sliding_window"], sliding_window_layers=windowed_layers(c),
        attn_logit_softcapping=c.get("attn_logit_softcapping"),
        final_logit_softcapping=c.get("final_logit_softcapping"), **special_token_fields(c))


def config(c: dict) -> ModelConfig:
    theta, scaling = rope_config_from_hf(c)
    return ModelConfig(architecture="gemma2", rope_theta=theta, rope_scaling=scaling, **gemma2_family_fields(c))


def layer_weights() -> dict:
    """A Gemma 2 layer's weights: four norms around the attention and the MLP."""
    return {
        "attn_norm": plus_one("input_layernorm.weight"),
        "w_qkv": hf("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "w_o": hf("self_attn.o_proj.weight"), "post_attn_norm": plus_one("post_attention_layernorm.weight"),
        "mlp_norm": plus_one("pre_feedforward_layernorm.weight"),
        "w_gate_up": hf("mlp.gate_proj.weight", "mlp.up_proj.weight"), "w_down": hf("mlp.down_proj.weight"),
        "post_mlp_norm": plus_one("post_feedforward_layernorm.weight"),
    }


def top_weights(cfg: ModelConfig) -> dict:
    return {"embed": hf("model.embed_tokens.weight"), "final_norm": plus_one("model.norm.weight"), **lm_head(cfg)}


def weights(cfg: ModelConfig) -> WeightMap:
    return WeightMap("model.layers.{i}.", layer_weights(), top_weights(cfg))


def sandwich_layer(cfg: ModelConfig, w: dict, layer, x, ctx: StepContext):
    """Each block's output is normalised again before it joins the residual stream."""
    x = x + norm(cfg, w, "post_attn_norm", layer, self_attention(cfg, w, layer, norm(cfg, w, "attn_norm", layer, x),
                                                                 ctx))
    return x + norm(cfg, w, "post_mlp_norm", layer, mlp(cfg, w, layer, norm(cfg, w, "mlp_norm", layer, x), ctx))


GEMMA2 = Architecture("gemma2", "Gemma2ForCausalLM", config, weights, sandwich_layer)
