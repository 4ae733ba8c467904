"""What a GGUF file's architecture changes in loading it: tensor names and layouts, and the config llama.cpp keeps in
code.

llama.cpp's converter (convert_hf_to_gguf.py) writes every family's tensors under one scheme (blk.N.attn_q, ...)
and some of a family's hyper-parameters nowhere in the file: llama.cpp's C++ (llama-model.cpp) knows them by the
architecture's name. Each family here says how to give our families (models/<family>.py) the HF names and layouts
they read, and the config the file lacks.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from jax_engine.model_config import ModelConfig
from jax_engine.models.alibi import bloom_slopes, mpt_slopes

# GGUF module -> HF module (each with its .weight and .bias): blk.N.<module> under the family's layer prefix, and
# the modules outside the layers. Llama's are the defaults.
LLAMA_LAYERS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
LLAMA_GLOBALS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# A layer's rows from the file's order to HF's (the tensor, the config): a permutation of whole rows, so the
# loader permutes a quantized tensor's raw block rows alike.
RowOrder = Callable[[np.ndarray, ModelConfig], np.ndarray]


@dataclass(frozen=True)
class GGUFFamily:
    model_type: str  # our family (ModelConfig.architecture, HF's model_type)
    layer_names: dict[str, str] = field(default_factory=lambda: LLAMA_LAYERS)
    global_names: dict[str, str] = field(default_factory=lambda: LLAMA_GLOBALS)
    layer_prefix: str = "model.layers.{i}."  # the family's HF layer names (its WeightMap's prefix)
    norms_plus_one: bool = False  # the converter stored Gemma's norms as 1 + weight
    norm_eps_key: str = "attention.layer_norm_rms_epsilon"  # LayerNorm families: attention.layer_norm_epsilon
    # (the file's key lookup under the architecture, hidden size, layers) -> ModelConfig fields, over the defaults
    config: Callable[..., dict] = lambda get, hidden, num_layers: {}
    row_order: dict[str, RowOrder] = field(default_factory=dict)  # by tensor within its layer: "attn_qkv.weight"
    # Tensors the converter wrote transposed (GPT-2's Conv1D [in, out] matrices as [out, in]): transposed back.
    # A transpose mixes the blocks of a row, so these are used dequantized only.
    transposed: frozenset[str] = frozenset()
    # Tokens that also end generation: llama.cpp treats these as end-of-generation by their text, whatever the
    # file's eos_token_id says (Gemma's chat turns end with <end_of_turn>, its EOS is <eos>).
    end_of_turn_tokens: tuple[str, ...] = ()
    chat_template: str | None = None  # for a file that has none (tokenizer.chat_template)


def undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation.

    llama.cpp's Llama converter reorders each head's rows from HF's "rotate half" layout
    [x0..x31 | x32..x63] to interleaved pairs (x0, x32, x1, x33, ...); we put them back.
    """
    per_head = weight.shape[0] // num_heads
    return weight.reshape(num_heads, per_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def group_qkv(weight: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Undo the GPT-NeoX, BLOOM and Falcon converters' fused-QKV rearrangement (rows or bias).

        file: [ all q heads | all k heads | all v heads ]
        HF:   per KV group g: [ q heads of g (G x D rows) | k head g | v head g ]   (G = queries per KV head)

    GPT-NeoX and BLOOM have one group per head (G = 1); Falcon one per KV head (its 7B, multi-query: one group,
    the same order as the file's).
    """
    kv, dim, rest = cfg.num_kv_heads, cfg.head_dim, weight.shape[1:]
    q_rows = cfg.num_heads * dim
    q = weight[:q_rows].reshape(kv, -1, dim, *rest)
    k, v = (part.reshape(kv, 1, dim, *rest) for part in np.split(weight[q_rows:], 2))
    return np.concatenate([q, k, v], axis=1).reshape(weight.shape)


_LLAMA_ROPE_ROWS = {"attn_q.weight": lambda w, cfg: undo_rope_permutation(w, cfg.num_heads),
                    "attn_k.weight": lambda w, cfg: undo_rope_permutation(w, cfg.num_kv_heads)}
_QKV_ROWS = {"attn_qkv.weight": group_qkv, "attn_qkv.bias": group_qkv}


def _gemma2_config(get, hidden: int, num_layers: int) -> dict:
    """llama.cpp's LLM_ARCH_GEMMA2: every other layer windowed, the first included (set_swa_pattern(2)), soft caps
    (50 and 30 where the file has none); scores scaled by 1/sqrt(key_length), except the 27B's 1/sqrt(hidden /
    heads)."""
    head_dim, heads = int(get("attention.key_length")), int(get("attention.head_count"))
    query_scalar = hidden / heads if num_layers == 46 else head_dim  # 46 layers: Gemma 2 27B
    return {"hidden_act": "gelu_pytorch_tanh", "embedding_multiplier": math.sqrt(hidden),
            "softmax_scale": query_scalar**-0.5, "sliding_window": int(get("attention.sliding_window", 4096)),
            "sliding_window_layers": tuple(i % 2 == 0 for i in range(num_layers)),
            "attn_logit_softcapping": float(get("attn_logit_softcapping", 50.0)),
            "final_logit_softcapping": float(get("final_logit_softcapping", 30.0))}


def _gemma3_config(get, hidden: int, num_layers: int) -> dict:
    """llama.cpp's LLM_ARCH_GEMMA3: every sixth layer global (set_swa_pattern(6)), the others windowed with RoPE
    base 10,000 unscaled; scores scaled by 1/sqrt(key_length), except the 27B's 1/sqrt(hidden / heads)."""
    head_dim, heads = int(get("attention.key_length")), int(get("attention.head_count"))
    query_scalar = hidden / heads if num_layers == 62 else head_dim  # 62 layers: Gemma 3 27B
    return {"hidden_act": "gelu_pytorch_tanh", "embedding_multiplier": math.sqrt(hidden),
            "softmax_scale": query_scalar**-0.5, "sliding_window": int(get("attention.sliding_window")),
            "sliding_window_layers": tuple(i % 6 < 5 for i in range(num_layers)), "rope_local_theta": 10000.0}


# Gemma 3's own chat template (its tokenizer_config.json's, for text): the system prompt opens the first user
# turn, and the assistant's role is "model". Gemma 3 GGUFs converted without it still chat as the model was
# trained to.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def _phi3_config(get, hidden: int, num_layers: int) -> dict:
    """Phi-3's window and the features of a head that rotate (partial_rotary_factor), as its converter writes them."""
    window, rotary = get("attention.sliding_window"), get("rope.dimension_count")
    return {"sliding_window": None if window is None else int(window),
            "rotary_dim": None if rotary is None else int(rotary)}


def _gemma_config(get, hidden: int, num_layers: int) -> dict:
    """llama.cpp's LLM_ARCH_GEMMA: a tanh-approximated GELU gate and embeddings scaled by sqrt(hidden)."""
    return {"hidden_act": "gelu_pytorch_tanh", "embedding_multiplier": math.sqrt(hidden)}


# The LayerNorm families: LayerNorms with biases and an ungated MLP, whose activation llama.cpp keeps in code (we
# take the HF family's: llama.cpp computes every GELU with the tanh approximation).
_LAYER_NORM = {"norm": "layer", "gated_mlp": False}


def _gptneox_config(get, hidden: int, num_layers: int) -> dict:
    """GPT-NeoX: the features of a head that rotate (rotary_pct) and whether attention and MLP run side by side."""
    return {**_LAYER_NORM, "hidden_act": "gelu", "rotary_dim": int(get("rope.dimension_count")),
            "parallel_residual": bool(get("use_parallel_residual", True))}


def _learned_positions(act: str) -> Callable[..., dict]:
    """GPT-2 and StarCoder: a table of positions (position_embd), no RoPE."""
    return lambda get, hidden, num_layers: {**_LAYER_NORM, "hidden_act": act, "position_embedding": "learned",
                                            "rope_theta": 0.0}


def _falcon_config(get, hidden: int, num_layers: int) -> dict:
    """llama.cpp's Falcon is the parallel one (7B, 40B): attention and MLP side by side."""
    return {**_LAYER_NORM, "hidden_act": "gelu", "parallel_residual": True}


def _bloom_config(get, hidden: int, num_layers: int) -> dict:
    slopes = bloom_slopes(int(get("attention.head_count")))
    return {**_LAYER_NORM, "hidden_act": "gelu_new", "position_embedding": "alibi", "alibi_slopes": slopes,
            "rope_theta": 0.0}


def _mpt_config(get, hidden: int, num_layers: int) -> dict:
    """MPT's ALiBi from the file's max_alibi_bias (0: no ALiBi, learned positions, which we do not read)."""
    if get("attention.clamp_kqv") is not None:
        raise ValueError("mpt.attention.clamp_kqv (clamped q/k/v) is not supported")
    bias_max = float(get("attention.max_alibi_bias", 0.0))
    if bias_max <= 0.0:
        raise ValueError("MPT files without ALiBi (mpt.attention.max_alibi_bias=0) are not supported")
    slopes = mpt_slopes(int(get("attention.head_count")), bias_max)
    return {**_LAYER_NORM, "hidden_act": "gelu", "position_embedding": "alibi", "alibi_slopes": slopes,
            "rope_theta": 0.0}


_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_GPT2_LAYERS = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
                "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GPT2_GLOBALS = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                 "output_norm": "transformer.ln_f", "output": "lm_head"}
_NEOX_LAYERS = {"attn_norm": "input_layernorm", "attn_qkv": "attention.query_key_value",
                "attn_output": "attention.dense", "ffn_norm": "post_attention_layernorm",
                "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}
_BLOOM_LAYERS = {**_NEOX_LAYERS, "attn_qkv": "self_attention.query_key_value", "attn_output": "self_attention.dense"}
_FALCON_LAYERS = {k: v for k, v in _BLOOM_LAYERS.items() if k != "ffn_norm"}
_MPT_LAYERS = {"attn_norm": "norm_1", "attn_qkv": "attn.Wqkv", "attn_output": "attn.out_proj", "ffn_norm": "norm_2",
               "ffn_up": "ffn.up_proj", "ffn_down": "ffn.down_proj"}
_LAYER_NORM_EPS = "attention.layer_norm_epsilon"
FAMILIES = {
    "llama": GGUFFamily("llama", row_order=_LLAMA_ROPE_ROWS),
    "mistral": GGUFFamily("mistral", row_order=_LLAMA_ROPE_ROWS),
    "qwen2": GGUFFamily("qwen2"),
    "qwen3": GGUFFamily("qwen3"),
    # q, k and v in one tensor, and gate and up in one (ffn_up), as the HF checkpoint has them
    "phi3": GGUFFamily("phi3", {**LLAMA_LAYERS, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                       config=_phi3_config),
    "gemma": GGUFFamily("gemma", norms_plus_one=True, config=_gemma_config, end_of_turn_tokens=("<end_of_turn>",)),
    "gemma2": GGUFFamily("gemma2", {**LLAMA_LAYERS, **_GEMMA_NORMS}, norms_plus_one=True, config=_gemma2_config,
                         end_of_turn_tokens=("<end_of_turn>",), chat_template=GEMMA3_CHAT_TEMPLATE),
    "gemma3": GGUFFamily("gemma3_text", {**LLAMA_LAYERS, **_GEMMA_NORMS}, norms_plus_one=True, config=_gemma3_config,
                         end_of_turn_tokens=("<end_of_turn>",), chat_template=GEMMA3_CHAT_TEMPLATE),
    "gptneox": GGUFFamily("gpt_neox", _NEOX_LAYERS, {"token_embd": "gpt_neox.embed_in", "output": "embed_out",
                                                     "output_norm": "gpt_neox.final_layer_norm"},
                          "gpt_neox.layers.{i}.", norm_eps_key=_LAYER_NORM_EPS, config=_gptneox_config,
                          row_order=_QKV_ROWS),
    "starcoder": GGUFFamily("gpt_bigcode", _GPT2_LAYERS, _GPT2_GLOBALS, "transformer.h.{i}.",
                            norm_eps_key=_LAYER_NORM_EPS, config=_learned_positions("gelu_pytorch_tanh")),
    # 7B-style files: one norm for attention and MLP (HF's input_layernorm); 40B-style ones: see gguf_family
    "falcon": GGUFFamily("falcon", _FALCON_LAYERS, {"token_embd": "transformer.word_embeddings",
                                                    "output_norm": "transformer.ln_f", "output": "lm_head"},
                         "transformer.h.{i}.", norm_eps_key=_LAYER_NORM_EPS, config=_falcon_config,
                         row_order=_QKV_ROWS),
    "bloom": GGUFFamily("bloom", _BLOOM_LAYERS, {"token_embd": "transformer.word_embeddings", "output": "lm_head",
                                                 "token_embd_norm": "transformer.word_embeddings_layernorm",
                                                 "output_norm": "transformer.ln_f"},
                        "transformer.h.{i}.", norm_eps_key=_LAYER_NORM_EPS, config=_bloom_config,
                        row_order=_QKV_ROWS),
    "mpt": GGUFFamily("mpt", _MPT_LAYERS, {"token_embd": "transformer.wte", "output_norm": "transformer.norm_f",
                                           "output": "lm_head"},
                      "transformer.blocks.{i}.", norm_eps_key=_LAYER_NORM_EPS, config=_mpt_config),
    "gpt2": GGUFFamily("gpt2", _GPT2_LAYERS, _GPT2_GLOBALS, "transformer.h.{i}.", norm_eps_key=_LAYER_NORM_EPS,
                       config=_learned_positions("gelu_new"),
                       transposed=frozenset(f"{m}.weight" for m in ("attn_qkv", "attn_output", "ffn_up", "ffn_down"))),
}
# Falcon-40B-style files (two norms a layer): llama.cpp's attn_norm feeds the MLP (HF's ln_mlp) and attn_norm_2
# the attention (HF's ln_attn), as gguf-py's tensor_mapping.py maps them.
_FALCON_40B = replace(FAMILIES["falcon"], layer_names={**_FALCON_LAYERS, "attn_norm": "ln_mlp",
                                                       "attn_norm_2": "ln_attn"})


def gguf_family(architecture: str, tensor_names: list[str]) -> GGUFFamily:
    """The family of a file of `architecture` with these tensors."""
    if architecture not in FAMILIES:
        raise ValueError(f"general.architecture={architecture!r} is not supported in GGUF files; supported: "
                         f"{sorted(FAMILIES)}")
    if architecture == "falcon" and any(name.endswith(".attn_norm_2.weight") for name in tensor_names):
        return _FALCON_40B
    return FAMILIES[architecture]
