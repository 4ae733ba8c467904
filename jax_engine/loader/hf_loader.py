"""Load a Hugging Face checkpoint directory: config.json, *.safetensors and tokenizer files."""

import json
import os

from jax_engine.loader.checkpoint import Checkpoint
from jax_engine.loader.generation_config import read_generation_config
from jax_engine.loader.safetensors_file import SafetensorsWeights, checkpoint_files
from jax_engine.model_config import ModelConfig


def config_from_hf(hf: dict) -> ModelConfig:
    """Translate an HF config.json dictionary into a ModelConfig, by its family (models/registry.py)."""
    return architecture(hf.get("model_type")).config(hf)


def architecture(model_type: str | None):
    """The family of `model_type` (models/registry.py), refused by name when none is."""
    # Imported here: a family's module also builds its Flax model, so the registry imports JAX (~1.4 s of CPU),
    # which an API server, loading only a tokenizer from this package, never needs.
    from jax_engine.models.registry import architecture as family

    return family(model_type)


# The files one of which a directory's tokenizer is read from (fast, SentencePiece, GPT-2's BPE, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken", "spiece.model")


def load_hf_directory(path: str, tokenizer: bool = True, trust_remote_code: bool = False,
                      hf_overrides: dict | None = None) -> Checkpoint:
    """Load config.json (with `hf_overrides`' keys replaced, vLLM's), the safetensors weights (one file or the
    shards of an index), the tokenizer (unless not `tokenizer`) and generation_config.json from `path`. Weights are
    float32 when read, whatever the files store. A directory without tokenizer files is refused unless
    `tokenizer` is False (skip_tokenizer_init)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path!r} has no config.json")
    with open(config_path) as f:
        architecture(json.load(f).get("model_type"))  # names the supported families before transformers reads it
    # Imported here: transformers takes ~0.6 s to import (its AutoTokenizer pulls in torch where it is installed,
    # ~2 s), which loading a GGUF file (the default model) never needs. AutoConfig fills in each family's defaults
    # for the fields a config.json leaves out, and reads older spellings (rotary_pct, rope_scaling) as transformers
    # does.
    from transformers import AutoConfig

    trust = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    config = config_from_hf({**AutoConfig.from_pretrained(path, **trust).to_dict(), **(hf_overrides or {})})
    weights = SafetensorsWeights(checkpoint_files(path))
    hf_tokenizer = directory_tokenizer(path, trust_remote_code) if tokenizer else None
    return Checkpoint(config, weights, hf_tokenizer, generation_config=read_generation_config(path))


def directory_tokenizer(path: str, trust_remote_code: bool = False):
    """A checkpoint directory's tokenizer (AutoTokenizer reads the chat template from chat_template.jinja or
    tokenizer_config.json); a directory without tokenizer files is refused, naming skip_tokenizer_init."""
    return _read_tokenizer(path, trust_remote_code, f"{path!r} has no tokenizer (none of "
                           f"{', '.join(TOKENIZER_FILES)}): add the model's tokenizer files, or pass "
                           "skip_tokenizer_init=True (--skip-tokenizer-init) to send token ids and get token ids back")


def load_tokenizer(path: str, vocab_size: int | None = None, trust_remote_code: bool = False):
    """The tokenizer of directory `path` (its chat template with it): the `tokenizer` argument. Refused, naming it,
    when the directory holds no tokenizer, or (given the model's `vocab_size`) more tokens than the model has rows
    for (check_tokenizer_fits)."""
    path = os.path.expanduser(path)
    tokenizer = _read_tokenizer(path, trust_remote_code, f"tokenizer={path!r} is not a directory holding tokenizer "
                                f"files (one of {', '.join(TOKENIZER_FILES)})")
    if vocab_size is not None:
        check_tokenizer_fits(tokenizer, vocab_size, path)
    return tokenizer


def _read_tokenizer(path: str, trust_remote_code: bool, refusal: str):
    """AutoTokenizer's tokenizer of directory `path`, or a ValueError saying `refusal` if it holds no tokenizer
    files."""
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ValueError(refusal)
    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)


def check_tokenizer_fits(tokenizer, vocab_size: int, path: str) -> None:
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer={path!r} has {len(tokenizer)} tokens, more than the model's vocab_size "
                         f"{vocab_size}: it is not this model's tokenizer")
