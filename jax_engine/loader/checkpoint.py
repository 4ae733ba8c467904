"""What every loader returns: a config, weights under HF names, and a tokenizer."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jax_engine.linear.gguf_format import BlockRows
from jax_engine.model_config import ModelConfig

if TYPE_CHECKING:  # not imported: an engine core loading a GGUF file runs without transformers (~0.6 s to import)
    from transformers import PreTrainedTokenizerBase


@dataclass
class Checkpoint:
    """A loaded model: its config, float32 weights under HF names, and its tokenizer."""

    config: ModelConfig
    # A dict, or SafetensorsWeights / GGUFWeights, which read (and dequantize) each tensor when asked for it.
    weights: Mapping[str, np.ndarray]
    tokenizer: "PreTrainedTokenizerBase | None"  # None: loaded with skip_tokenizer_init
    # A GGUF file's matrices in the block formats the engine keeps, as the file stores them (each its format and
    # raw rows, uint8 [out, row bytes], views of the mapped file), under the same names: what quantization="gguf"
    # keeps instead of the float32 weights.
    blocks: dict[str, BlockRows] = field(default_factory=dict)
    # generation_config.json: the authors' sampling defaults and end-of-sequence ids (loader/generation_config.py).
    generation_config: dict = field(default_factory=dict)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The config's EOS ids (generation_config may list several), else the tokenizer's."""
        eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        return tuple(self.config.eos_token_ids) or ((eos,) if eos is not None else ())
