"""Load a Hugging Face checkpoint directory: config.json, *.safetensors and tokenizer files."""

import json
import os

from jax_engine.loader.checkpoint import Checkpoint
from jax_engine.loader.generation_config import read_generation_config
from jax_engine.loader.safetensors_file import SafetensorsWeights, checkpoint_files
from jax_engine.model_config import ModelConfig
from jax_engine.models.registry import architecture


def config_from_hf(hf: dict) -> ModelConfig:
    """Translate an HF config.json dictionary into a ModelConfig, by its family (models/registry.py)."""
    return architecture(hf.get("model_type")).config(hf)


def load_hf_directory(path: str) -> Checkpoint:
    """Load config.json, the safetensors weights (one file or the shards of an index), the tokenizer and
    generation_config.json from `path`. Weights are float32 when read, whatever the files store."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path!r} has no config.json")
    with open(config_path) as f:
        architecture(json.load(f).get("model_type"))  # names the supported families before transformers reads it
    # Imported here: transformers' AutoTokenizer pulls in torch where it is installed (~2 s), which loading
    # a GGUF file (the default model) never needs. AutoConfig fills in each family's defaults for the fields
    # a config.json leaves out, and reads older spellings (rotary_pct, rope_scaling) as transformers does.
    from transformers import AutoConfig, AutoTokenizer

    config = config_from_hf(AutoConfig.from_pretrained(path, local_files_only=True).to_dict())
    weights = SafetensorsWeights(checkpoint_files(path))
    # AutoTokenizer reads the chat template from chat_template.jinja or tokenizer_config.json.
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return Checkpoint(config, weights, tokenizer, generation_config=read_generation_config(path))
