"""What a model family supplies: its config.json translation, where its weights come from, its decoder layer."""

from collections.abc import Callable
from dataclasses import dataclass

import jax

from jax_engine.model_config import ModelConfig, token_ids
from jax_engine.models.layers import StepContext
from jax_engine.models.weights import Source, WeightMap, hf

# (cfg, the stacked weights by name, layer index, hidden states [T, H], step context) -> hidden states [T, H]
LayerFn = Callable[[ModelConfig, dict, jax.Array, jax.Array, StepContext], jax.Array]


@dataclass(frozen=True)
class Architecture:
    """One family of decoder-only models.

    name: our name (ModelConfig.architecture), HF's `model_type`.
    hf_class: the transformers class the tests compare against (and docs/models.md lists).
    config: config.json (as a dict, with transformers' defaults filled in) -> ModelConfig.
    weights: where each weight comes from (models/weights.py).
    layer: the decoder layer.
    """

    name: str
    hf_class: str
    config: Callable[[dict], ModelConfig]
    weights: Callable[[ModelConfig], WeightMap]
    layer: LayerFn


def special_token_fields(hf: dict) -> dict:
    """The BOS / EOS ids every family's config.json may carry."""
    return {"bos_token_id": hf.get("bos_token_id"), "eos_token_ids": token_ids(hf.get("eos_token_id"))}


def unsupported(hf: dict, field: str, expected, why: str, where: str = "config.json") -> None:
    """A config.json setting the engine does not build (anything but `expected`): a ValueError naming the
    family, the field and its value."""
    if hf.get(field, expected) != expected:
        raise ValueError(f"{where}: {field}={hf[field]!r} is not supported ({why})")


def lm_head(cfg: ModelConfig, name: str = "lm_head.weight") -> dict[str, Source]:
    """The LM head's source, or none when it is the embedding (tie_word_embeddings)."""
    return {} if cfg.tie_word_embeddings else {"lm_head": hf(name)}
