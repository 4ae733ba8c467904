"""RoPE scaling as a checkpoint configures it (HF's `rope_scaling` / `rope_parameters`), and the context it gives.

Configuration only, in plain Python (rope.py computes the frequencies and rotates): the loaders read it into
ModelConfig without importing JAX.
"""

from dataclasses import dataclass

ROPE_SCALING_TYPES = ("linear", "dynamic", "llama3", "yarn")
SUPPORTED_ROPE_TYPES = ("default", *ROPE_SCALING_TYPES)  # "default": plain RoPE, no scaling


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE past the context it was trained on (HF's `rope_scaling`).

    Frozen and hashable: it sits in ModelConfig, which jit treats as static.

    Attributes:
        rope_type: "linear", "dynamic", "llama3" or "yarn".
        factor: how many times longer the context gets.
        original_max_position_embeddings: the context the model was trained on. For "linear" and "dynamic"
            it is the config's max_position_embeddings, as in HF.
        low_freq_factor, high_freq_factor: llama3's wavelength bounds, in fractions of the original context.
        beta_fast, beta_slow: yarn's ramp bounds, in rotations over the original context.
        mscale, mscale_all_dim: yarn's (DeepSeek's) way to derive the attention factor.
        attention_factor: yarn's multiplier of cos and sin; None derives it from factor (and mscale).
        truncate: yarn rounds its correction range to whole dimensions (HF's default).
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not supported; expected one of {ROPE_SCALING_TYPES}")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")


# --------------------------------------------------------------------------------------------- config.json
def rope_config_from_hf(hf: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from an HF config.json dictionary.

    Older configs write `rope_theta` at the top level and `rope_scaling` = {"type" or "rope_type", ...};
    transformers 5 writes `rope_parameters` = {"rope_type", "rope_theta", ...} instead (as LlamaConfig does).
    As in transformers, `rope_scaling` wins over `rope_parameters`, and a theta inside the dict over the top
    level one. rope_type "default" means no scaling.

    Raises:
        ValueError: an unsupported rope type (naming the field and the supported types), a missing required
            parameter, or parameters per layer type (Gemma 3's), which no supported family uses.
    """
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(field) or {}
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"{field} per layer type ({sorted(params)}) is not supported")
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{field}['rope_type']={rope_type!r} is not supported; supported rope types: "
                         f"{SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    return theta, _scaling_from_hf(field, params, rope_type, hf)


def _scaling_from_hf(field: str, params: dict, rope_type: str, hf: dict) -> RopeScaling:
    max_positions = hf.get("max_position_embeddings", 2048)
    # NOTE: as transformers' standardize_rope_params: a top-level original_max_position_embeddings (Phi-3's
    # way) wins over the one in the dict; "linear" and "dynamic" scale from max_position_embeddings itself.
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if rope_type in ("linear", "dynamic") or original is None:
        original = max_positions
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":  # DeepSeek-V3's way: the ratio of the two lengths
        factor = max_positions / original
    required = ("factor", "low_freq_factor", "high_freq_factor") if rope_type == "llama3" else ("factor",)
    for name in required:
        if (params | {"factor": factor}).get(name) is None:
            raise ValueError(f"{field}[{name!r}] is required for rope_type {rope_type!r}")
    floats = {name: float(params[name]) for name in ("low_freq_factor", "high_freq_factor", "mscale", "mscale_all_dim",
                                                     "attention_factor") if params.get(name) is not None}
    # HF reads a beta of 0 or None as its default too.
    betas = {name: float(params[name]) for name in ("beta_fast", "beta_slow") if params.get(name)}
    return RopeScaling(rope_type, float(factor), int(original), truncate=bool(params.get("truncate", True)),
                       **floats, **betas)


def max_len_with_rope_scaling(max_position_embeddings: int, scaling: RopeScaling | None) -> int:
    """The longest context the model serves: vLLM's derived max_model_len (config `_get_and_verify_max_len`).

    NOTE: llama3 (like longrope) configs already write the stretched length in max_position_embeddings;
    linear and dynamic configs write the original one, which the factor stretches; yarn stretches its
    original_max_position_embeddings, whatever max_position_embeddings says.
    """
    if scaling is None or scaling.rope_type == "llama3":
        return max_position_embeddings
    start = scaling.original_max_position_embeddings if scaling.rope_type == "yarn" else max_position_embeddings
    return int(start * scaling.factor)
