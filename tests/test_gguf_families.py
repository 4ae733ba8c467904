"""GGUF files of each family, written here as llama.cpp's converter (convert_hf_to_gguf.py) writes
them from a tiny HF checkpoint, then loaded and compared with the HF model they came from, logits position by
position. (The real Gemma 3 270M file is checked against transformers and llama.cpp in test_gemma3_gguf.py, an
optional extra.)"""

import math

import numpy as np
import pytest
from tokenizers import pre_tokenizers

from jax_engine.loader import load_checkpoint
from tests.engine_helpers import engine_logits
from tests.test_gguf_tokenizers import BYTE_LEVEL_SPECIALS, write_gguf
from tests.test_llama_vs_hf import PROMPT, hf_logits
from tests.test_rope import CASES, PROMPT as ROPE_PROMPT  # 48 tokens: past the llama3 case's original context
from tests.tiny_checkpoints import make_tiny_checkpoint

# HF module -> GGUF tensor, as llama.cpp's converter maps them (gguf-py's tensor_mapping.py).
LLAMA_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
GEMMA3_NAMES = {**LLAMA_NAMES, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
# llama.cpp's Gemma 3: every sixth layer global (set_swa_pattern(6)); the tiny model has six layers to show it.
GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]


def byte_level_fields(eos: int = 257) -> dict:
    """The tiny checkpoints' 258-token byte-level vocabulary as GGUF tokenizer metadata."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
            "tokenizer.ggml.tokens": alphabet + BYTE_LEVEL_SPECIALS, "tokenizer.ggml.token_type": [1] * 256 + [3, 3],
            "tokenizer.ggml.eos_token_id": eos}


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's rotate-half halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def gguf_tensors(hf_model, names: dict[str, str], norm_shift: float = 0.0,
                 permute: bool = False) -> dict[str, np.ndarray]:
    """An HF model's weights as the converter writes them: its names, q/k rows interleaved for llama.cpp's RoPE
    when `permute` (the Llama converter; the Qwen, Phi-3 and Gemma ones keep them), and every norm plus
    `norm_shift` (Gemma stores 1 + weight)."""
    cfg = hf_model.config
    heads = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}
    tensors = {}
    for name, value in hf_model.state_dict().items():
        array = value.numpy() + (norm_shift if name.endswith("norm.weight") else 0.0)
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = value.numpy()
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = array
        elif name == "lm_head.weight":
            tensors["output.weight"] = array
        elif name.startswith("model.layers."):
            layer, module = name.removeprefix("model.layers.").split(".", 1)
            module, kind = module.rsplit(".", 1)
            array = _permute(array, heads[module]) if permute and module in heads else array
            tensors[f"blk.{layer}.{names[module]}.{kind}"] = array
    return tensors


def hparams(cfg) -> dict:
    return {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
            "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
            "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
            "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps}


def logit_diff(checkpoint, hf_model) -> float:
    expected = hf_logits(hf_model, PROMPT)
    return float(np.abs(engine_logits(checkpoint, PROMPT, [len(PROMPT) - 2, 1, 1]) - expected).max())


def llama3_rope_freqs(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors): llama3 scaling as one divisor of
    each rotating pair's inverse frequency."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_rope_freqs_gguf_matches_hf_llama3_scaling(tmp_path):
    """A Llama 3.1-style GGUF (llama3 scaling as rope_freqs) gives the logits of the HF checkpoint it came from."""
    case = CASES["llama3"]  # theta 20000, original context 32: the 48-token prompt runs past it
    hf_model = make_tiny_checkpoint(tmp_path, "llama", **case)
    cfg = hf_model.config
    factors = llama3_rope_freqs(cfg.head_dim, case["rope_theta"], case["rope_scaling"])
    tensors = gguf_tensors(hf_model, LLAMA_NAMES, permute=True) | {"rope_freqs.weight": factors}
    path = write_gguf(tmp_path / "llama31.gguf", byte_level_fields(), tensors,
                      {**hparams(cfg), "rope.freq_base": case["rope_theta"], "rope.dimension_count": cfg.head_dim})
    checkpoint = load_checkpoint(path)
    assert checkpoint.config.rope_scaling is None
    assert checkpoint.config.rope_freq_factors == tuple(float(f) for f in factors)
    assert {1.0, case["rope_scaling"]["factor"]} < set(checkpoint.config.rope_freq_factors), "kept, divided, blended"
    expected = hf_logits(hf_model, ROPE_PROMPT)
    # A prefill, then two decode-like steps, as test_rope.py's end-to-end cases.
    diff = np.abs(engine_logits(checkpoint, ROPE_PROMPT, [len(ROPE_PROMPT) - 2, 1, 1]) - expected).max()
    print(f"rope_freqs GGUF vs HF llama3: max |logit diff| = {diff:.2e} over {len(ROPE_PROMPT)} positions")
    # float32 factors and float32 sums in another order: we see ~5e-7 on logits of magnitude ~1. Plain RoPE
    # (the factors ignored) misses by ~3e-3 here (test_rope.py).
    assert diff < 1e-5



@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_a_qwen_gguf_gives_the_logits_of_its_hf_checkpoint(tmp_path, architecture):
    """Qwen2's q/k/v biases, Qwen3's q/k norms; neither converter permutes q/k rows as the Llama one does."""
    hf_model = make_tiny_checkpoint(tmp_path, architecture)
    path = write_gguf(tmp_path / "model.gguf", byte_level_fields(), gguf_tensors(hf_model, LLAMA_NAMES),
                      {**hparams(hf_model.config), "rope.freq_base": hf_model.config.rope_parameters["rope_theta"]},
                      architecture=architecture)
    diff = logit_diff(load_checkpoint(path), hf_model)
    print(f"{architecture} GGUF vs HF: max |logit diff| = {diff:.2e}")
    assert diff < 1e-5  # float32 sums in another order


def test_a_gemma_gguf_gives_the_logits_of_its_hf_checkpoint(tmp_path):
    """Gemma 1: norms stored as 1 + weight; its GELU and sqrt(hidden) embedding scale are llama.cpp's code, not
    the file's."""
    hf_model = make_tiny_checkpoint(tmp_path, "gemma", head_dim=24)  # as Gemma 7B: heads x head_dim != hidden
    tensors = gguf_tensors(hf_model, LLAMA_NAMES, 1.0)
    tensors.pop("output.weight", None)  # the converter skips Gemma's lm_head: it is the embedding
    cfg = hf_model.config
    path = write_gguf(tmp_path / "gemma.gguf", byte_level_fields(), tensors, hparams(cfg), architecture="gemma")
    checkpoint = load_checkpoint(path)
    assert checkpoint.config.tie_word_embeddings and checkpoint.config.head_dim == cfg.head_dim
    diff = logit_diff(checkpoint, hf_model)
    print(f"Gemma GGUF vs HF: max |logit diff| = {diff:.2e}")
    assert diff < 1e-5  # float32 sums in another order


def test_a_phi3_gguf_gives_the_logits_of_its_hf_checkpoint(tmp_path):
    """Phi-3's fused qkv and gate/up tensors, its sliding window and partial rotation from the file's keys."""
    hf_model = make_tiny_checkpoint(tmp_path, "phi3", sliding_window=8, partial_rotary_factor=0.5)
    names = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up", **LLAMA_NAMES}
    cfg = hf_model.config
    path = write_gguf(tmp_path / "phi3.gguf", byte_level_fields(), gguf_tensors(hf_model, names),
                      {**hparams(cfg), "rope.freq_base": cfg.rope_parameters["rope_theta"],
                       "attention.sliding_window": 8, "rope.dimension_count": cfg.head_dim // 2},
                      architecture="phi3")
    checkpoint = load_checkpoint(path)
    assert (checkpoint.config.sliding_window, checkpoint.config.rotary_dim) == (8, cfg.head_dim // 2)
    diff = logit_diff(checkpoint, hf_model)
    print(f"Phi-3 GGUF vs HF: max |logit diff| = {diff:.2e}")
    assert diff < 1e-5  # float32 sums in another order


def test_a_gemma2_gguf_gives_the_logits_of_its_hf_checkpoint(tmp_path):
    """Gemma 2's soft caps and window from the file's keys, every other layer windowed as llama.cpp has it."""
    hf_model = make_tiny_checkpoint(tmp_path, "gemma2", num_hidden_layers=4, query_pre_attn_scalar=16)
    cfg = hf_model.config
    caps = {"attn_logit_softcapping": cfg.attn_logit_softcapping,
            "final_logit_softcapping": cfg.final_logit_softcapping}
    path = write_gguf(tmp_path / "gemma2.gguf", byte_level_fields(), gguf_tensors(hf_model, GEMMA3_NAMES, 1.0),
                      {**hparams(cfg), "rope.freq_base": cfg.rope_parameters["rope_theta"],
                       "attention.sliding_window": cfg.sliding_window, **caps}, architecture="gemma2")
    checkpoint = load_checkpoint(path)
    assert checkpoint.config.sliding_window_layers == (True, False, True, False)
    diff = logit_diff(checkpoint, hf_model)
    print(f"Gemma 2 GGUF vs HF: max |logit diff| = {diff:.2e}")
    assert diff < 1e-5  # float32 sums in another order; the norms' 1 + w - 1 round trip is exact for these


def test_a_gemma3_gguf_gives_the_logits_of_its_hf_checkpoint(tmp_path):
    hf_model = make_tiny_checkpoint(tmp_path, "gemma3_text", num_hidden_layers=6, layer_types=GEMMA3_LAYERS,
                                    query_pre_attn_scalar=16)  # llama.cpp scales by key_length (16)
    cfg = hf_model.config
    path = write_gguf(tmp_path / "gemma3.gguf", byte_level_fields(), gguf_tensors(hf_model, GEMMA3_NAMES, 1.0),
                      {**hparams(cfg), "rope.freq_base": 1e6, "attention.sliding_window": cfg.sliding_window},
                      architecture="gemma3")
    checkpoint = load_checkpoint(path)
    assert checkpoint.config.sliding_window_layers == (True,) * 5 + (False,)
    diff = logit_diff(checkpoint, hf_model)
    print(f"Gemma 3 GGUF vs HF: max |logit diff| = {diff:.2e}")
    assert diff < 1e-5  # float32 sums in another order; the norms' 1 + w - 1 round trip is exact for these
