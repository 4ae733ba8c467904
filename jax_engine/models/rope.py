"""Rotary position embeddings (RoPE): the scaled frequencies, the cos/sin tables and the rotation.

The inverse frequencies depend on the model only, so they are computed once in NumPy (float64, then rounded
to float32) and enter the jitted step as constants; the tables depend on the step's positions. Each scaling
type reproduces transformers' `modeling_rope_utils._compute_*_parameters` (the functions named below), so
a checkpoint gives HF's logits. Dimension names: T tokens, R rotary features of a head (R <= D, the head dim).
"""

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

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


# --------------------------------------------------------------------------------------------- frequencies
def rope_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling | None,
                     freq_factors: tuple[float, ...] | None = None) -> tuple[np.ndarray, float]:
    """The inverse frequencies of the R/2 rotating pairs and the attention factor that multiplies cos and sin.

    Args:
        rotary_dim: R, the features of a head that rotate (even; the head dim unless the rotary is partial).
        theta: the base wavelength (rope_theta).
        scaling: None for plain RoPE.
        freq_factors: [R/2] divisors of the inverse frequencies, after any scaling: llama.cpp's rope_freqs
            tensor (ggml_rope_ext's freq_factors), which Llama 3.1+ GGUFs carry instead of a llama3 rope_scaling.

    Returns:
        (inv_freq [R/2] float32, attention factor: 1.0 except for yarn).

    Raises:
        ValueError: freq_factors of another length than R/2.
    """
    if freq_factors is not None and len(freq_factors) != rotary_dim // 2:
        raise ValueError(f"{len(freq_factors)} rope frequency factors for {rotary_dim // 2} rotating pairs "
                         f"(rotary_dim={rotary_dim})")
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    inv_freq = 1.0 / theta**exponents  # [R/2]
    attention_factor = 1.0
    if scaling is not None:
        if scaling.rope_type == "linear":  # _compute_linear_scaling_rope_parameters
            inv_freq = inv_freq / scaling.factor
        elif scaling.rope_type == "dynamic":
            inv_freq = 1.0 / _dynamic_ntk_theta(rotary_dim, theta, scaling) ** exponents
        elif scaling.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        else:
            inv_freq, attention_factor = _yarn_inv_freq(inv_freq, rotary_dim, theta, scaling), _yarn_factor(scaling)
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
    return inv_freq.astype(np.float32), attention_factor


def _dynamic_ntk_theta(rotary_dim: int, theta: float, scaling: RopeScaling) -> float:
    # NOTE: HF's _compute_dynamic_ntk_parameters raises the base with the length of the sequence being run
    # (and keeps theta up to the original context), so a position's angle depends on how long the sequence
    # is; no paged KV cache can hold that. vLLM's DynamicNTKScalingRotaryEmbedding fixes the base once, for
    # max_len = original context * factor, which is HF's base for a sequence of exactly that length.
    original = scaling.original_max_position_embeddings
    max_len = original * scaling.factor
    return theta * (scaling.factor * max_len / original - (scaling.factor - 1)) ** (rotary_dim / (rotary_dim - 2))


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    # _compute_llama3_parameters: wavelengths shorter than original/high_freq_factor keep their frequency,
    # longer than original/low_freq_factor are divided by factor, and those between are blended.
    original = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = np.where(wavelen > original / low, inv_freq / scaling.factor, inv_freq)
    return np.where((wavelen >= original / high) & (wavelen <= original / low), blended, scaled)


def _yarn_inv_freq(inv_freq: np.ndarray, rotary_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    # _compute_yarn_parameters: pairs turning more than beta_fast times over the original context keep their
    # frequency (extrapolation), fewer than beta_slow times are divided by factor (interpolation), and a
    # linear ramp over the pair index blends those between.
    def correction_dim(rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return inv_freq / scaling.factor * (1 - extrapolation) + inv_freq * extrapolation


def _yarn_factor(scaling: RopeScaling) -> float:
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


# --------------------------------------------------------------------------------------------- rotation
def rope_tables(positions: jax.Array, inv_freq: np.ndarray, attention_factor: float = 1.0
                ) -> tuple[jax.Array, jax.Array]:
    """cos and sin of each position's angles, times the attention factor.

    Args:
        positions: [T] token positions.
        inv_freq: [R/2] from rope_frequencies.
        attention_factor: multiplies cos and sin (yarn's mscale); 1.0 otherwise.

    Returns:
        (cos, sin), each [T, 1, R/2] float32: the 1 broadcasts over heads.
    """
    angles = positions.astype(jnp.float32)[:, None, None] * jnp.asarray(inv_freq, jnp.float32)[None, None, :]
    if attention_factor == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleaved: bool = False) -> jax.Array:
    """Rotate the first R = 2 * cos.shape[-1] features of each head; the rest pass through unchanged.

    Pair i of a head (angle position * inv_freq[i]) is, for R = 8:

        rotate-half (Llama, GPT-NeoX):  (x[i], x[i + R/2])   x0 x1 x2 x3 | x4 x5 x6 x7   pairs 0-4 1-5 2-6 3-7
        interleaved (GPT-J):            (x[2i], x[2i + 1])   x0 x1 | x2 x3 | x4 x5 | x6 x7

    Args:
        x: [T, heads, D] queries or keys, D >= R (partial rotary: GPT-NeoX's rotary_pct, Phi).
        cos, sin: [T, 1, R/2] float32, from rope_tables.
        interleaved: the GPT-J layout instead of rotate-half.

    Returns:
        x rotated, [T, heads, D] in x's dtype (the rotation itself in float32).
    """
    rotary = 2 * cos.shape[-1]
    if rotary > x.shape[-1]:
        raise ValueError(f"the tables rotate {rotary} features but x has {x.shape[-1]} per head ({x.shape})")
    xr = x[..., :rotary].astype(jnp.float32)  # [T, heads, R]
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., : rotary // 2], xr[..., rotary // 2:])
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin  # [T, heads, R/2] each
    rotated = jnp.stack([r1, r2], axis=-1).reshape(xr.shape) if interleaved else jnp.concatenate([r1, r2], -1)
    if rotary == x.shape[-1]:
        return rotated.astype(x.dtype)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rotary:]], axis=-1)
