"""GPT-2 (OpenAI, 2019) and GPT-BigCode / StarCoder (BigCode, 2023): learned positions, LayerNorm, GELU MLP.

    x = wte(tokens) + wpe(positions)
    L x  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))
    -> ln_f -> logits (LM head tied to wte)

GPT-2 stores its matrices as Conv1D weights, [in, out]: transposed here to the [out, in] of every other
family. Its fused c_attn holds all q rows, then k, then v. GPT-BigCode has the same layers with ordinary
Linear weights and multi-query attention: c_attn is q (H rows), then one key head and one value head.
"""

from functools import partial

import numpy as np

from jax_engine.model_config import ModelConfig
from jax_engine.models.architecture import Architecture, lm_head, special_token_fields, unsupported
from jax_engine.models.layers import pre_norm_layer
from jax_engine.models.weights import WeightMap, derived, hf, ungroup_qkv


def config(c: dict) -> ModelConfig:
    unsupported(c, "scale_attn_weights", True, "attention without the 1/sqrt(head_dim) scale")
    unsupported(c, "scale_attn_by_inverse_layer_idx", False, "per-layer attention scales")
    hidden, heads = c["n_embd"], c["n_head"]
    kv_heads = 1 if c.get("multi_query") else heads
    return ModelConfig(
        architecture=c["model_type"], vocab_size=c["vocab_size"], hidden_size=hidden,
        intermediate_size=c["n_inner"] or 4 * hidden, num_layers=c["n_layer"], num_heads=heads,
        num_kv_heads=kv_heads, head_dim=hidden // heads, rope_theta=0.0, norm_eps=c["layer_norm_epsilon"],
        max_position_embeddings=c["n_positions"], tie_word_embeddings=c["tie_word_embeddings"], norm="layer",
        hidden_act=c["activation_function"], gated_mlp=False, position_embedding="learned",
        **special_token_fields(c))


def weights(cfg: ModelConfig) -> WeightMap:
    conv1d = cfg.architecture == "gpt2"  # GPT-2's [in, out] matrices; BigCode's are [out, in] already
    matrix = (lambda name: derived(np.transpose, name)) if conv1d else hf
    qkv_rows = (lambda w: w) if conv1d or cfg.num_kv_heads == 1 else partial(
        ungroup_qkv, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)  # BigCode without MQA: per head
    c_attn_weight = (lambda w: qkv_rows(w.T)) if conv1d else qkv_rows
    layer = {
        "attn_norm": hf("ln_1.weight"), "attn_norm_bias": hf("ln_1.bias"),
        "w_qkv": derived(c_attn_weight, "attn.c_attn.weight"), "b_qkv": derived(qkv_rows, "attn.c_attn.bias"),
        "w_o": matrix("attn.c_proj.weight"), "b_o": hf("attn.c_proj.bias"),
        "mlp_norm": hf("ln_2.weight"), "mlp_norm_bias": hf("ln_2.bias"),
        "w_up": matrix("mlp.c_fc.weight"), "b_up": hf("mlp.c_fc.bias"),
        "w_down": matrix("mlp.c_proj.weight"), "b_down": hf("mlp.c_proj.bias"),
    }
    top = {"embed": hf("transformer.wte.weight"), "positions": hf("transformer.wpe.weight"),
           "final_norm": hf("transformer.ln_f.weight"), "final_norm_bias": hf("transformer.ln_f.bias"),
           **lm_head(cfg)}
    return WeightMap("transformer.h.{i}.", layer, top)


GPT2 = Architecture("gpt2", "GPT2LMHeadModel", config, weights, pre_norm_layer)
GPT_BIGCODE = Architecture("gpt_bigcode", "GPTBigCodeForCausalLM", config, weights, pre_norm_layer)
