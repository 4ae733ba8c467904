"""The one checkpoint loader: GGUF (default model) and HF directories, checked against transformers."""

import json
import os

import numpy as np
import pytest

from jax_engine.loader import default_model_path, load_checkpoint
from jax_engine.models.causal_lm import CausalLM
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
    assert "model.layers.0.self_attn.q_proj.bias" in checkpoint.weights and tokenizer.decode(tokenizer.encode("a b")) == "a b"
    assert len(tokenizer.encode("a b")) == 3 and tokenizer.eos_token_id == 257


def test_bad_model_paths_and_configs_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        load_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type='bert' is not supported; supported: .*'gpt2'"):
        load_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="rope_scaling.*'longrope' is not supported"):
        config_from_hf({"model_type": "llama", "rope_scaling": {"type": "longrope"}})


def test_load_format_insists_on_its_kind_of_model(tiny_checkpoint_dir):
    """vLLM's load_format: "auto" reads either kind; "gguf" or "safetensors" refuse a model of the other kind,
    naming both, before anything is read."""
    from jax_engine import EngineArgs
    from jax_engine.loader import load_engine_checkpoint

    for model, load_format in ((tiny_checkpoint_dir, "gguf"), (None, "safetensors")):
        with pytest.raises(ValueError, match=f"load_format='{load_format}', but model={model!r} is a"):
            load_engine_checkpoint(EngineArgs(model, load_format=load_format))
    checkpoint = load_engine_checkpoint(EngineArgs(tiny_checkpoint_dir, load_format="safetensors",
                                                   tokenizer_mode="hf"))
    assert checkpoint.config.vocab_size == load_checkpoint(tiny_checkpoint_dir).config.vocab_size


@pytest.mark.parametrize("save_dtype, max_shard_size", [("bfloat16", "100KB"), ("float16", None)])
def test_16_bit_and_sharded_safetensors_load_as_float32(tmp_path, save_dtype, max_shard_size):
    """Most releases are bf16, large ones sharded: the loader reads both without torch, widened exactly."""
    hf_model = make_tiny_checkpoint(tmp_path, "llama", save_dtype=save_dtype, max_shard_size=max_shard_size,
                                    tie_word_embeddings=False)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == (max_shard_size is not None)
    checkpoint = load_checkpoint(str(tmp_path))
    state = hf_model.state_dict()
    assert set(checkpoint.weights) == set(state)
    assert all(checkpoint.weights[k].dtype == np.float32 for k in state)
    assert all(np.array_equal(checkpoint.weights[k], state[k].numpy()) for k in state)


def test_bfloat16_widening_equals_ml_dtypes():
    """Checked against an independent bfloat16 implementation (ml_dtypes, jax's), specials included."""
    import ml_dtypes

    from jax_engine.loader.safetensors_file import bfloat16_to_float32

    values = np.concatenate([np.random.default_rng(0).standard_normal(1000) * 10.0 ** np.arange(-20, 20, 0.04),
                             [0.0, -0.0, np.inf, -np.inf, 1e-40]]).astype(ml_dtypes.bfloat16)
    widened = bfloat16_to_float32(values.view(np.uint16))
    assert np.array_equal(widened.view(np.uint32), values.astype(np.float32).view(np.uint32))


def test_checkpoint_errors_name_the_file_and_field(tmp_path):
    make_tiny_checkpoint(tmp_path, "llama", max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    os.rename(tmp_path / shard, tmp_path / "elsewhere")
    with pytest.raises(FileNotFoundError, match=f"missing: \\['{shard}'\\]"):
        load_checkpoint(str(tmp_path))
    untied = tmp_path / "untied"
    make_tiny_checkpoint(untied, "llama", tie_word_embeddings=True)
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(ValueError, match=r"no 'lm_head.weight' \(config.json sets tie_word_embeddings=false\)"):
        checkpoint = load_checkpoint(str(untied))
        CausalLM.from_hf_weights(checkpoint.config, checkpoint.weights)


def test_chat_template_from_tokenizer_config_or_its_own_file(tmp_path):
    """Releases keep the template in tokenizer_config.json (older) or chat_template.jinja (newer)."""
    from tests.tiny_checkpoints import CHAT_TEMPLATE

    make_tiny_checkpoint(tmp_path, "llama")
    messages = [{"role": "user", "content": "Hi"}]
    expected = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    jinja = tmp_path / "chat_template.jinja"
    assert jinja.read_text() == CHAT_TEMPLATE
    render = lambda: load_checkpoint(str(tmp_path)).tokenizer.apply_chat_template(  # noqa: E731
        messages, add_generation_prompt=True, tokenize=False)
    assert render() == expected
    jinja.unlink()
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    assert "chat_template" not in config
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    assert render() == expected


CUSTOM_TOKENIZER = '''from transformers import PreTrainedTokenizerFast


class EchoingTokenizerFast(PreTrainedTokenizerFast):
    """A checkpoint's own tokenizer code: what trust_remote_code lets transformers import."""
'''


def checkpoint_with_its_own_tokenizer_code(directory) -> str:
    """The tiny checkpoint, whose tokenizer_config.json names a tokenizer class of its own (auto_map)."""
    make_tiny_checkpoint(directory, "llama")
    (directory / "tokenization_echoing.py").write_text(CUSTOM_TOKENIZER)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    auto_map = {"AutoTokenizer": [None, "tokenization_echoing.EchoingTokenizerFast"]}
    config_path.write_text(json.dumps({**config, "tokenizer_class": "EchoingTokenizerFast", "auto_map": auto_map}))
    return str(directory)


def test_trust_remote_code_runs_a_checkpoints_tokenizer_code(tmp_path):
    """vLLM's trust_remote_code: a tokenizer named by the directory's auto_map loads only with it, and is that
    class, in LLM(...) as in load_checkpoint; without it transformers' error names the argument."""
    from jax_engine import LLM, SamplingParams

    directory = checkpoint_with_its_own_tokenizer_code(tmp_path)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        load_checkpoint(directory)
    llm = LLM(directory, trust_remote_code=True, num_gpu_blocks_override=16, block_size=8, max_model_len=64,
              enforce_eager=True)
    assert type(llm.get_tokenizer()).__name__ == "EchoingTokenizerFast"
    [output] = llm.generate("ab", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3


def test_serve_with_trust_remote_code_hands_the_tokenizer_to_the_api_server(tmp_path):
    """The engine core sends its tokenizer to the API server pickled: a checkpoint's own class must import there
    too (the server failed to start before)."""
    import httpx

    from tests.server_helpers import TINY_ENGINE_ARGS, cli_flags, start_server_process, stop_server_process

    directory = checkpoint_with_its_own_tokenizer_code(tmp_path / "model")
    process, url = start_server_process(directory, *cli_flags(**TINY_ENGINE_ARGS), "--trust-remote-code",
                                        log_path=str(tmp_path / "server.log"))
    try:
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 3, "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3, reply.text
    finally:
        stop_server_process(process)


def test_hf_overrides_replace_config_json_keys(tiny_checkpoint_dir):
    """vLLM's hf_overrides (--hf-overrides JSON): config.json keys replaced before the model is built; refused for a
    GGUF file, whose configuration is its metadata, and when not a dict of keys."""
    import argparse

    from jax_engine import LLM, EngineArgs, SamplingParams
    from jax_engine.loader import load_engine_checkpoint

    plain = load_checkpoint(tiny_checkpoint_dir).config
    # transformers 5 keeps rope_theta in rope_parameters: a key is replaced whole, as vLLM sets a config attribute
    overrides = {"rope_parameters": {"rope_type": "default", "rope_theta": plain.rope_theta * 2},
                 "max_position_embeddings": 64}
    config = load_engine_checkpoint(EngineArgs(tiny_checkpoint_dir, hf_overrides=overrides)).config
    assert (config.rope_theta, config.max_position_embeddings) == (plain.rope_theta * 2, 64)
    assert config.hidden_size == plain.hidden_size
    llm = LLM(tiny_checkpoint_dir, hf_overrides={"max_position_embeddings": 64}, num_gpu_blocks_override=16,
              block_size=8, enforce_eager=True)
    assert llm.llm_engine.scheduler_config.max_model_len == 64  # the overridden length is the model's
    assert len(llm.generate([[256, 5, 6]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="hf_overrides replace a checkpoint directory's config.json keys"):
        load_engine_checkpoint(EngineArgs(hf_overrides={"rope_theta": 1.0}))  # the default model: a GGUF file
    with pytest.raises(ValueError, match="hf_overrides must be None or a dict, got"):
        EngineArgs(tiny_checkpoint_dir, hf_overrides=[1])
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parsed = EngineArgs.from_cli_args(parser.parse_args(["--hf-overrides", '{"rope_theta": 1000.0}']))
    assert parsed.hf_overrides == {"rope_theta": 1000.0}
