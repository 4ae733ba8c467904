"""RoPE scaling and the rotary variants (jax_engine/models/rope.py) against transformers and direct formulas.

The end-to-end tests print the max logit difference they saw (pytest -s).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jax_engine.config import EngineArgs, resolve_scheduler_config
from jax_engine.loader import load_checkpoint
from jax_engine.loader.hf_loader import config_from_hf
from jax_engine.models.rope import apply_rope, rope_frequencies, rope_tables
from jax_engine.models.rope_scaling import ROPE_SCALING_TYPES, max_len_with_rope_scaling, rope_config_from_hf
from reference.llama import rope as reference_rope
from tests.engine_helpers import engine_logits
from tests.test_llama_vs_hf import hf_logits
from tests.tiny_checkpoints import hf_config, make_tiny_checkpoint

PROMPT = [256, *np.random.default_rng(0).integers(0, 256, 47).tolist()]  # 48 tokens

# Tiny Llama configs whose original context (16 or 32 positions) the 48-token prompt runs well past. The
# theta of 20000 checks that it is read from transformers 5's rope_parameters, where LlamaConfig writes it.
CASES = {
    "linear": dict(max_position_embeddings=16, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    # HF's dynamic base depends on the sequence's length; ours is fixed for original * factor = 48 tokens.
    "dynamic": dict(max_position_embeddings=16, rope_scaling={"type": "dynamic", "factor": 3.0}),
    # Wavelengths 6.3, 21.9, 76.5, ... against 32 / 4 and 32 / 1: the kept, blended and divided pairs all occur.
    "llama3": dict(rope_theta=20000.0, max_position_embeddings=128,
                   rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # Pair 0 extrapolates, the others interpolate; cos and sin are scaled by 0.1 ln 4 + 1.
    "yarn": dict(max_position_embeddings=64,
                 rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
}


def _hf_dict(overrides: dict) -> dict:
    """config.json's dictionary as transformers 5 writes it for a tiny Llama with these overrides."""
    return hf_config("llama", **overrides).to_dict() | {"model_type": "llama"}


@pytest.mark.parametrize("rope_type", CASES)
def test_scaled_rope_checkpoints_match_hf_past_the_original_context(tmp_path, rope_type):
    hf_model = make_tiny_checkpoint(tmp_path, "llama", **CASES[rope_type])
    checkpoint = load_checkpoint(str(tmp_path))
    assert checkpoint.config.rope_scaling.rope_type == rope_type
    expected = hf_logits(hf_model, PROMPT)
    # A prefill, then two decode-like steps: positions 46 and 47 come through the decode path's metadata.
    ours = engine_logits(checkpoint, PROMPT, [len(PROMPT) - 2, 1, 1])
    diff = np.abs(ours - expected).max()
    print(f"{rope_type}: max |logit diff| = {diff:.2e} over {len(PROMPT)} positions")
    # float32 sums in another order and float32 frequencies rounded from float64 (HF: float32 throughout):
    # we see ~5e-7 on logits of magnitude ~1; 1e-5 leaves headroom. Plain RoPE misses by 3e-3 to 7e-3.
    assert diff < 1e-5


# Other parameters than the end-to-end cases: mscale (DeepSeek), betas, truncate=False, an explicit
# attention_factor, llama3 with theta 500000 (Llama 3.1's) and a partial rotary dim.
FREQUENCY_CASES = [*CASES.values(),
                   dict(max_position_embeddings=256, rope_scaling={  # a ramp over pairs 0.2..2.0, not 0..3
                       "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                       "mscale_all_dim": 1.0, "beta_fast": 8, "beta_slow": 1, "truncate": False}),
                   dict(max_position_embeddings=64, rope_scaling={
                       "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                       "attention_factor": 0.9}),
                   dict(rope_theta=500000.0, max_position_embeddings=512, rope_scaling={
                       "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}),
                   dict(max_position_embeddings=16, partial_rotary_factor=0.5,
                        rope_scaling={"rope_type": "linear", "factor": 2.0})]


@pytest.mark.parametrize("overrides", FREQUENCY_CASES, ids=[*CASES, "yarn-mscale", "yarn-attention-factor",
                                                              "llama3-theta-500000", "linear-partial"])
def test_frequencies_and_attention_factor_equal_transformers(overrides):
    config = hf_config("llama", **overrides)
    params = config.rope_parameters
    dynamic = params["rope_type"] == "dynamic"  # HF at original * factor tokens: see CASES["dynamic"]
    seq_len = int(config.max_position_embeddings * params["factor"]) if dynamic else None
    expected, expected_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, seq_len=seq_len)
    theta, scaling = rope_config_from_hf(_hf_dict(overrides))
    rotary_dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
    inv_freq, factor = rope_frequencies(rotary_dim, theta, scaling)
    # float64 rounded to float32 against transformers' float32 arithmetic: a few ulps.
    np.testing.assert_allclose(inv_freq, expected.numpy(), rtol=1e-6)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


def _rope_by_formula(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, interleaved: bool) -> np.ndarray:
    """Each pair as a complex number a + ib, multiplied by exp(i * position * inv_freq), in float64."""
    R = 2 * len(inv_freq)
    first, second = (slice(0, R, 2), slice(1, R, 2)) if interleaved else (slice(0, R // 2), slice(R // 2, R))
    z = (x[..., first] + 1j * x[..., second]) * np.exp(1j * positions[:, None, None] * inv_freq.astype(np.float64))
    out = x.astype(np.float64)
    out[..., first], out[..., second] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 6])
def test_apply_rope_equals_the_formula(rotary_dim, interleaved):
    """Rotate-half and GPT-J's interleaved pairs, over the whole head or its first rotary_dim features."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 16)).astype(np.float32)  # [T, heads, D]
    positions = np.array([0, 1, 7, 30, 63])
    inv_freq, _ = rope_frequencies(rotary_dim, 10000.0, None)
    cos, sin = rope_tables(jnp.asarray(positions), inv_freq)
    ours = np.asarray(apply_rope(jnp.asarray(x), cos, sin, interleaved=interleaved))
    # float32 angles (position * inv_freq rounded) against float64 ones: up to ~4e-6 rad at position 63.
    np.testing.assert_allclose(ours, _rope_by_formula(x, positions, inv_freq, interleaved), atol=1e-4)
    np.testing.assert_array_equal(ours[..., rotary_dim:], x[..., rotary_dim:])  # the rest passes untouched
    if rotary_dim == 16 and not interleaved:  # the oracle's rope, which the reference model uses
        np.testing.assert_allclose(ours, reference_rope(x, positions, 10000.0), atol=1e-4)


def test_rope_tables_longer_than_the_head_are_an_error():
    cos, sin = rope_tables(jnp.arange(3), rope_frequencies(16, 10000.0, None)[0])
    with pytest.raises(ValueError, match="rotate 16 features but x has 8"):
        apply_rope(jnp.zeros((3, 2, 8)), cos, sin)


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
def test_unsupported_rope_types_and_missing_parameters_are_value_errors(field):
    supported = r"\('default', 'linear', 'dynamic', 'llama3', 'yarn'\)"
    for rope_type in ("longrope", "su", "mrope"):
        with pytest.raises(ValueError, match=rf"{field}\['rope_type'\]='{rope_type}' is not supported.*{supported}"):
            rope_config_from_hf({field: {"rope_type": rope_type, "factor": 2.0}})
    with pytest.raises(ValueError, match=rf"{field}\['factor'\] is required for rope_type 'linear'"):
        rope_config_from_hf({field: {"type": "linear"}})
    with pytest.raises(ValueError, match=rf"{field}\['low_freq_factor'\] is required for rope_type 'llama3'"):
        rope_config_from_hf({field: {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}})


def test_config_forms_old_and_new():
    """Older configs: top-level rope_theta, "type"; transformers 5: everything under rope_parameters."""
    theta, scaling = rope_config_from_hf({"rope_theta": 500000.0, "max_position_embeddings": 4096,
                                          "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (theta, scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings) == (
        500000.0, "linear", 2.0, 4096)
    assert rope_config_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}) == (100000.0, None)
    assert rope_config_from_hf({}) == (10000.0, None)
    cfg = config_from_hf(_hf_dict(CASES["llama3"]))
    assert cfg.rope_theta == 20000.0 and cfg.rope_scaling.original_max_position_embeddings == 32
    assert hash(cfg) == hash(config_from_hf(_hf_dict(CASES["llama3"])))  # static jit metadata
    assert (cfg.rotary_dim, cfg.rope_interleaved) == (None, False)


# vLLM's derived max_model_len: linear and dynamic stretch max_position_embeddings, yarn its original
# context, and llama3's max_position_embeddings is already the stretched length.
@pytest.mark.parametrize("rope_type, expected", [("linear", 64), ("dynamic", 48), ("llama3", 128), ("yarn", 64)])
def test_max_model_len_follows_vllm(rope_type, expected):
    cfg = config_from_hf(_hf_dict(CASES[rope_type]))
    assert max_len_with_rope_scaling(cfg.max_position_embeddings, cfg.rope_scaling) == expected
    assert resolve_scheduler_config(EngineArgs(), cfg).max_model_len == expected
    with pytest.raises(ValueError, match=f"scaled by its rope_scaling to {expected}"):
        resolve_scheduler_config(EngineArgs(max_model_len=expected + 1), cfg)
    assert set(ROPE_SCALING_TYPES) == set(CASES)
