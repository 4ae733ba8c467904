"""Rotary position embeddings (RoPE): the scaled frequencies, the cos/sin tables and the rotation.

The inverse frequencies depend on the model only, so they are computed once in NumPy (float64, then rounded
to float32) and enter the jitted step as constants; the tables depend on the step's positions. Each scaling
type reproduces transformers' `modeling_rope_utils._compute_*_parameters` (the functions named below), so
a checkpoint gives HF's logits. Dimension names: T tokens, R rotary features of a head (R <= D, the head dim).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.models.rope_scaling import RopeScaling


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
