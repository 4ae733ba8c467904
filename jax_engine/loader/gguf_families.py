"""What a GGUF file's architecture changes in loading it: tensor names, and the config llama.cpp keeps in code.

llama.cpp's converter (convert_hf_to_gguf.py) writes every family's tensors under one scheme (blk.N.attn_q, ...)
and some of a family's hyper-parameters nowhere in the file: llama.cpp's C++ (llama-model.cpp) knows them by the
architecture's name. Each family here says what its files need on top of the Llama-style defaults of
gguf_loader.py.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GGUFFamily:
    model_type: str  # our family (ModelConfig.architecture, HF's model_type)
    layer_names: dict[str, str] = field(default_factory=dict)  # GGUF tensor -> HF name, beside the defaults
    norms_plus_one: bool = False  # the converter stored Gemma's norms as 1 + weight
    # (the file's key lookup under the architecture, hidden size, layers) -> more ModelConfig fields
    config: Callable[..., dict] = lambda get, hidden, num_layers: {}
    permuted_qk: bool = False  # the converter interleaved q/k rows for llama.cpp's RoPE (its Llama converter)
    # Tokens that also end generation: llama.cpp treats these as end-of-generation by their text, whatever the
    # file's eos_token_id says (Gemma's chat turns end with <end_of_turn>, its EOS is <eos>).
    end_of_turn_tokens: tuple[str, ...] = ()
    chat_template: str | None = None  # for a file that has none (tokenizer.chat_template)


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


_GEMMA_NORMS = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
FAMILIES = {
    "llama": GGUFFamily("llama", permuted_qk=True),
    "mistral": GGUFFamily("mistral", permuted_qk=True),
    "qwen2": GGUFFamily("qwen2"),
    "qwen3": GGUFFamily("qwen3"),
    # q, k and v in one tensor, and gate and up in one (ffn_up), as the HF checkpoint has them
    "phi3": GGUFFamily("phi3", {"attn_qkv.weight": "self_attn.qkv_proj.weight",
                                "ffn_up.weight": "mlp.gate_up_proj.weight"}, config=_phi3_config),
    "gemma3": GGUFFamily("gemma3_text", _GEMMA_NORMS, norms_plus_one=True, config=_gemma3_config,
                         end_of_turn_tokens=("<end_of_turn>",), chat_template=GEMMA3_CHAT_TEMPLATE),
}


def gguf_family(architecture: str) -> GGUFFamily:
    if architecture not in FAMILIES:
        raise ValueError(f"general.architecture={architecture!r} is not supported in GGUF files; supported: "
                         f"{sorted(FAMILIES)}")
    return FAMILIES[architecture]
