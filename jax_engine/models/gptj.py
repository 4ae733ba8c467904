"""GPT-J (EleutherAI, 2021): one LayerNorm feeding attention and MLP side by side, interleaved rotary.

    x = wte(tokens)
    L x  h = ln_1(x);  x = x + attn(h) + mlp(h)
    -> ln_f -> lm_head (with a bias)

RoPE turns the first rotary_dim features of each head, in pairs (x[2i], x[2i+1]) ("rotate every two"),
not rotate-half's (x[i], x[i + R/2]).
"""

from jax_engine.model_config import ModelConfig
from jax_engine.models.architecture import Architecture, lm_head, special_token_fields
from jax_engine.models.layers import mlp, norm, self_attention
from jax_engine.models.weights import WeightMap, hf


def config(c: dict) -> ModelConfig:
    if not c.get("rotary_dim"):
        raise ValueError("gptj config.json: rotary_dim=None (rotary over the whole hidden state) is not supported")
    hidden, heads = c["n_embd"], c["n_head"]
    return ModelConfig(
        architecture="gptj", vocab_size=c["vocab_size"], hidden_size=hidden, intermediate_size=c["n_inner"] or 4 * hidden,
        num_layers=c["n_layer"], num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, rope_theta=10000.0,
        rotary_dim=c["rotary_dim"], rope_interleaved=True, norm_eps=c["layer_norm_epsilon"],
        max_position_embeddings=c["n_positions"], tie_word_embeddings=c["tie_word_embeddings"], norm="layer",
        hidden_act=c["activation_function"], gated_mlp=False, parallel_residual=True, **special_token_fields(c))


def weights(cfg: ModelConfig) -> WeightMap:
    layer = {
        "attn_norm": hf("ln_1.weight"), "attn_norm_bias": hf("ln_1.bias"),
        "w_qkv": hf("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"),
        "w_o": hf("attn.out_proj.weight"),
        "w_up": hf("mlp.fc_in.weight"), "b_up": hf("mlp.fc_in.bias"),
        "w_down": hf("mlp.fc_out.weight"), "b_down": hf("mlp.fc_out.bias"),
    }
    top = {"embed": hf("transformer.wte.weight"), "final_norm": hf("transformer.ln_f.weight"),
           "final_norm_bias": hf("transformer.ln_f.bias"), **lm_head(cfg),
           "lm_head_bias": hf("lm_head.bias", optional=True)}
    return WeightMap("transformer.h.{i}.", layer, top)


def layer(cfg: ModelConfig, w: dict, i, x, ctx):
    h = norm(cfg, w, "attn_norm", i, x)
    return x + self_attention(cfg, w, i, h, ctx) + mlp(cfg, w, i, h, ctx)


GPTJ = Architecture("gptj", "GPTJForCausalLM", config, weights, layer)
