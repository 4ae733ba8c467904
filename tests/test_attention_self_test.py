"""The start-up self-test of the Pallas attention kernels (jax_engine/runner/attention_self_test.py), on CPU with
the kernels in the Pallas interpreter: the real kernels pass on a GQA model with a sliding window and on an ALiBi
model; a real kernel made to compute something else (a fault given as the candidate) fails, and the engine then
serves on xla or stops, as attention_self_test says; an engine built end to end runs the test and serves."""

import logging

import jax.numpy as jnp
import pytest

from jax_engine import LLM, EngineArgs, SamplingParams
from jax_engine.attention import AttentionBackend, get_attention_backend
from jax_engine.models.alibi import bloom_slopes
from jax_engine.runner.attention_self_test import (AttentionSelfTestError, AttentionShapes, checked_backend,
                                                   compare)
from tests.tiny_checkpoints import make_tiny_checkpoint

PALLAS = get_attention_backend("pallas", "cpu")  # interpreted
# GQA (2 query heads per KV head) with a window shorter than the contexts, in float32.
GQA_WINDOW = AttentionShapes(num_heads=4, num_kv_heads=2, head_dim=16, scale=16**-0.5, sliding_window=8,
                             alibi_slopes=None, dtype=jnp.float32, block_size=16, max_model_len=256)
# BLOOM's slopes for 6 heads (not a power of two), in bfloat16: the loosest tolerance a fault must still break.
ALIBI = AttentionShapes(num_heads=6, num_kv_heads=6, head_dim=8, scale=8**-0.5, sliding_window=None,
                        alibi_slopes=bloom_slopes(6), dtype=jnp.bfloat16, block_size=8, max_model_len=256)
LOGGER = "jax_engine.runner.attention_self_test"


def with_fault(scale_factor: float = 1.0, window_change: int = 0):
    """The Pallas backend's own attention function, called with its scale or sliding window off."""

    def attend(q, k, v, k_cache, v_cache, layer, metadata, block_size, scale, *, sliding_window=None,
               alibi_slopes=None, logits_soft_cap=None):
        window = None if sliding_window is None else sliding_window + window_change
        return PALLAS.attend(q, k, v, k_cache, v_cache, layer, metadata, block_size, scale * scale_factor,
                             sliding_window=window, alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap)

    return attend


@pytest.mark.parametrize("shapes", [GQA_WINDOW, ALIBI], ids=["gqa-window-float32", "alibi-bfloat16"])
def test_the_pallas_kernels_pass(shapes):
    result = compare(PALLAS.attend, shapes, compiled=False)
    print(result)
    assert result.passed and set(result.differences) == {"decode and prefill (ragged kernel)",
                                                         "decode only (decode kernel)"}


@pytest.mark.parametrize("shapes, fault", [(GQA_WINDOW, with_fault(window_change=1)),
                                           (ALIBI, with_fault(scale_factor=1.1))],
                         ids=["window-one-token-longer", "scale-10%-off"])
def test_a_kernel_computing_something_else_fails_on_both_steps(shapes, fault):
    result = compare(fault, shapes, compiled=False)
    print(result)
    assert not result.passed
    assert all(diff > result.tolerance for diff in result.differences.values()), result


BROKEN = AttentionBackend("pallas", with_fault(window_change=1), ragged=False, default_block_size=16)


def test_a_failing_self_test_falls_back_to_xla_and_logs_the_difference(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        backend = checked_backend("fallback", BROKEN, GQA_WINDOW, "cpu")
    assert backend.name == "xla"
    [record] = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.WARNING
    assert "differ from the xla path by" in record.getMessage() and "serving on the xla" in record.getMessage()


def test_auto_tests_only_compiled_kernels_and_falls_back_too():
    assert checked_backend("auto", BROKEN, GQA_WINDOW, "cpu") is BROKEN  # interpreted: not tested
    assert checked_backend("off", BROKEN, GQA_WINDOW, "gpu") is BROKEN
    # On a GPU it runs (the candidate here is still interpreted, held to the compiled tolerance).
    assert checked_backend("auto", BROKEN, GQA_WINDOW, "gpu").name == "xla"


def test_a_failing_self_test_stops_the_engine_with_error():
    with pytest.raises(AttentionSelfTestError, match=r"differ from the xla path by [\d.]+, more than the tolerance "
                                                     r"[\d.e-]+ for float32"):
        checked_backend("error", BROKEN, GQA_WINDOW, "cpu")


def test_the_engine_runs_the_self_test_and_serves_on_pallas(tmp_path, caplog):
    """A Mistral-style checkpoint whose window (8) the prompts pass, through LLM(model=...)."""
    make_tiny_checkpoint(tmp_path, "mistral", sliding_window=8)
    args = dict(model=str(tmp_path), block_size=16, num_gpu_blocks_override=32, max_model_len=128, max_num_seqs=4,
                max_num_batched_tokens=128, enforce_eager=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        pallas = LLM(attention_backend="pallas", attention_self_test="fallback", **args)
    assert pallas.llm_engine.attention_backend.name == "pallas"
    assert any("attention self-test passed" in r.getMessage() for r in caplog.records)
    xla = LLM(attention_backend="xla", **args)
    prompts = ["The quick brown fox jumps over the lazy dog", "a b c d e f g h i j"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for llm in (pallas, xla)]
    assert tokens[0] == tokens[1]


def test_a_bad_attention_self_test_value_names_the_field():
    with pytest.raises(ValueError, match=r"attention_self_test must be one of \('auto', 'fallback', 'error', "
                                         r"'off'\), got 'sometimes'"):
        EngineArgs(attention_self_test="sometimes")
