"""Gemma 3 (Google, 2025), text: Gemma 2's layers with q/k norms, and a RoPE base per kind of layer.

    x = embed(tokens) * sqrt(H)
    L x  x = x + rms(attn(rms(x)));  x = x + rms(down(gelu(gate(rms(x))) * up(rms(x))))
    -> rms -> logits (LM head tied to the embedding)

Most layers are local: they attend to their last `sliding_window` tokens and rotate by their own RoPE base
(`rope_local_base_freq`, 10,000); every sixth (config.json's `layer_types`) is global: all tokens, RoPE base
`rope_theta` (1,000,000, scaled in the larger models). Both kinds run in the one layer scan, each layer's window
and RoPE tables picked by its index (CausalLM's `_per_layer`). q and k are RMS-normalised per head before RoPE,
and the scores are scaled by `query_pre_attn_scalar`^-1/2. Every norm multiplies by (1 + weight), added once at
load time as in Gemma. Gemma 3's released configs set no soft caps (Gemma 2's); any set are applied as there.
"""

from jax_engine.model_config import ModelConfig
from jax_engine.models.architecture import Architecture
from jax_engine.models.gemma import plus_one
from jax_engine.models.gemma2 import gemma2_family_fields, layer_weights, sandwich_layer, top_weights
from jax_engine.models.rope_scaling import rope_config_from_hf
from jax_engine.models.weights import WeightMap


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
    if "layer_types" not in c:
        raise ValueError("config.json: Gemma 3 needs layer_types (one of 'sliding_attention' or 'full_attention' "
                         "per layer)")
    theta, scaling, local_theta = _rope(c)
    return ModelConfig(architecture="gemma3_text", rope_theta=theta, rope_scaling=scaling,
                       rope_local_theta=local_theta, **gemma2_family_fields(c))


def weights(cfg: ModelConfig) -> WeightMap:
    layer = {**layer_weights(), "q_norm": plus_one("self_attn.q_norm.weight"),
             "k_norm": plus_one("self_attn.k_norm.weight")}
    return WeightMap("model.layers.{i}.", layer, top_weights(cfg))


GEMMA3 = Architecture("gemma3_text", "Gemma3ForCausalLM", config, weights, sandwich_layer)
