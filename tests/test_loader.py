"""The one checkpoint loader: GGUF (default model) and HF directories, checked against transformers."""

import json
import os

import numpy as np
import pytest

from jax_engine.loader import default_model_path, load_checkpoint
from jax_engine.loader.hf_loader import config_from_hf
from tests.tiny_checkpoints import make_tiny_checkpoint

TEXTS = ["Hello world 12345  foo", "  héllo\n\n\tworld!! 3.14159 日本語 <|im_end|>x", "What is the capital of France?"]


def test_default_model_config(default_checkpoint):
    c = default_checkpoint.config
    shape = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size, c.rope_theta)
    assert shape == (30, 576, 9, 3, 64, 49152, 100000.0)
    assert c.tie_word_embeddings and c.eos_token_ids == (2,)
    assert 134_000_000 < c.num_params < 135_000_000
    assert sum(w.size for w in default_checkpoint.weights.values()) == c.num_params
    assert all(w.dtype == np.float32 for w in default_checkpoint.weights.values())


def test_gguf_weights_equal_transformers_own_gguf_loader(default_checkpoint):
    """transformers dequantizes and un-permutes q/k itself: an independent check of ours."""
    from transformers import AutoModelForCausalLM

    directory, filename = os.path.split(default_model_path())
    state = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename).state_dict()
    diffs = {name: float(np.abs(state[name].numpy() - w).max()) for name, w in default_checkpoint.weights.items()}
    print(f"max |weight diff| vs transformers' GGUF loader: {max(diffs.values())}")
    assert max(diffs.values()) == 0.0


def test_gguf_tokenizer_equals_transformers_conversion(default_checkpoint):
    from transformers import AutoTokenizer

    directory, filename = os.path.split(default_model_path())
    theirs = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    ours = default_checkpoint.tokenizer
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == text
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_chat_template_comes_from_the_gguf_metadata(default_checkpoint):
    text = default_checkpoint.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" in text


def test_hf_directory_weights_round_trip(tmp_path):
    hf_model = make_tiny_checkpoint(tmp_path, "qwen2")
    checkpoint = load_checkpoint(str(tmp_path))
    state = hf_model.state_dict()
    assert set(checkpoint.weights) == set(state)
    assert all(np.array_equal(checkpoint.weights[k], state[k].numpy()) for k in state)
    tokenizer = checkpoint.tokenizer
    assert checkpoint.config.attention_bias and tokenizer.decode(tokenizer.encode("a b")) == "a b"
    assert len(tokenizer.encode("a b")) == 3 and tokenizer.eos_token_id == 257


def test_bad_model_paths_and_configs_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        load_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        load_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="rope_scaling"):
        config_from_hf({"model_type": "llama", "rope_scaling": {"type": "yarn"}})
