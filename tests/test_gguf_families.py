"""GGUF files of the families beyond Llama, written here as llama.cpp's converter (convert_hf_to_gguf.py) writes
them from a tiny HF checkpoint, then loaded and compared with the HF model they came from, logits position by
position. (The real Gemma 3 270M file is checked against transformers and llama.cpp in test_gemma3_gguf.py, an
optional extra.)"""

import numpy as np
from tokenizers import pre_tokenizers

from jax_engine.loader import load_checkpoint
from tests.engine_helpers import engine_logits
from tests.test_gguf_tokenizers import BYTE_LEVEL_SPECIALS, write_gguf
from tests.test_llama_vs_hf import PROMPT, hf_logits
from tests.tiny_checkpoints import make_tiny_checkpoint

# HF module -> GGUF tensor, as llama.cpp's converter maps Gemma 3's (gguf-py's tensor_mapping.py).
GEMMA3_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
# llama.cpp's Gemma 3: every sixth layer global (set_swa_pattern(6)); the tiny model has six layers to show it.
GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]


def byte_level_fields(eos: int = 257) -> dict:
    """The tiny checkpoints' 258-token byte-level vocabulary as GGUF tokenizer metadata."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
            "tokenizer.ggml.tokens": alphabet + BYTE_LEVEL_SPECIALS, "tokenizer.ggml.token_type": [1] * 256 + [3, 3],
            "tokenizer.ggml.eos_token_id": eos}


def gemma3_gguf_tensors(hf_model) -> dict[str, np.ndarray]:
    """Gemma 3's weights as the converter writes them: its names, every norm as 1 + weight, q/k rows as they are."""
    tensors = {}
    for name, value in hf_model.state_dict().items():
        array = value.numpy() + (1.0 if name.endswith("norm.weight") else 0.0)
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = value.numpy()
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = array
        elif name.startswith("model.layers."):
            layer, module = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            tensors[f"blk.{layer}.{GEMMA3_NAMES[module]}.weight"] = array
    return tensors


def test_a_gemma3_gguf_gives_the_logits_of_its_hf_checkpoint(tmp_path):
    hf_model = make_tiny_checkpoint(tmp_path, "gemma3_text", num_hidden_layers=6, layer_types=GEMMA3_LAYERS,
                                    query_pre_attn_scalar=16)  # llama.cpp scales by key_length (16)
    cfg = hf_model.config
    hparams = {"block_count": 6, "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
               "feed_forward_length": cfg.intermediate_size, "attention.head_count": cfg.num_attention_heads,
               "attention.head_count_kv": cfg.num_key_value_heads, "attention.key_length": cfg.head_dim,
               "attention.value_length": cfg.head_dim, "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
               "rope.freq_base": 1e6, "attention.sliding_window": cfg.sliding_window}
    path = write_gguf(tmp_path / "gemma3.gguf", byte_level_fields(), gemma3_gguf_tensors(hf_model), hparams,
                      architecture="gemma3")
    checkpoint = load_checkpoint(path)
    assert checkpoint.config.sliding_window_layers == (True,) * 5 + (False,)
    expected = hf_logits(hf_model, PROMPT)
    diff = np.abs(engine_logits(checkpoint, PROMPT, [len(PROMPT) - 2, 1, 1]) - expected).max()
    print(f"Gemma 3 GGUF vs HF: max |logit diff| = {diff:.2e}")
    assert diff < 1e-5  # float32 sums in another order; the norms' 1 + w - 1 round trip is exact for these
