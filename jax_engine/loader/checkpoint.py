"""What every loader returns: a config, weights under HF names, and a tokenizer."""

from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from jax_engine.model_config import ModelConfig


@dataclass
class Checkpoint:
    """A loaded model: its config, float32 weights under HF names, and its tokenizer."""

    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: PreTrainedTokenizerBase

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The config's EOS ids (generation_config may list several), else the tokenizer's."""
        eos = self.tokenizer.eos_token_id
        return tuple(self.config.eos_token_ids) or ((eos,) if eos is not None else ())
