"""Load a Hugging Face checkpoint directory: config.json, *.safetensors and tokenizer files."""

import json
import os

from jax_engine.loader.checkpoint import Checkpoint
from jax_engine.loader.generation_config import read_generation_config, token_ids
from jax_engine.loader.safetensors_file import SafetensorsWeights, checkpoint_files
from jax_engine.model_config import ModelConfig

# HF `model_type` -> our architecture name.
_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def config_from_hf(hf: dict) -> ModelConfig:
    """Translate an HF config.json dictionary into a ModelConfig."""
    model_type = hf.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"model_type={model_type!r} is not supported; expected one of {list(_ARCHITECTURES)}")
    if hf.get("rope_scaling"):
        raise ValueError(f"rope_scaling={hf['rope_scaling']!r} is not supported yet")
    num_heads = hf["num_attention_heads"]
    return ModelConfig(
        architecture=_ARCHITECTURES[model_type],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_norm_eps=float(hf["rms_norm_eps"]),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=token_ids(hf.get("eos_token_id")),
    )


def load_hf_directory(path: str) -> Checkpoint:
    """Load config.json, the safetensors weights (one file or the shards of an index), the tokenizer and
    generation_config.json from `path`. Weights are float32 when read, whatever the files store."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path!r} has no config.json")
    with open(config_path) as f:
        config = config_from_hf(json.load(f))
    weights = SafetensorsWeights(checkpoint_files(path))
    if not config.tie_word_embeddings and "lm_head.weight" not in weights:
        raise ValueError(f"{config_path!r} sets tie_word_embeddings=false but the weights have no lm_head.weight")
    # Imported here: transformers' AutoTokenizer pulls in torch where it is installed (~2 s), which loading
    # a GGUF file (the default model) never needs. It reads the chat template from chat_template.jinja or
    # tokenizer_config.json.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return Checkpoint(config, weights, tokenizer, generation_config=read_generation_config(path))
