"""kv_cache_dtype (vLLM's flag): keys and values stored in bfloat16 or 8-bit floats beside the float32 model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_engine import SamplingParams
from jax_engine.attention import cpu, pallas, xla
from jax_engine.kv_cache_plan import resolve_kv_cache_dtype
from tests.conftest import LLM_ARGS
from tests.test_attention_backends import DECODE, MIXED, make_step

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
SCORE = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)


def prompt_logprobs(llm, token_ids: list[int]) -> np.ndarray:
    """The log-probability of each prompt token after the ones before it."""
    [out] = llm.generate([token_ids], SCORE, use_tqdm=False)
    return np.array([step[token].logprob for step, token in zip(out.prompt_logprobs[1:], token_ids[1:])])


@pytest.fixture(scope="module")
def bf16_llm(make_llm):
    return make_llm(**dict(LLM_ARGS, kv_cache_dtype="bfloat16"))


@pytest.fixture(scope="module")
def fp8_llm(make_llm):
    return make_llm(**dict(LLM_ARGS, kv_cache_dtype="fp8"))


def attend_over_a_narrow_cache(attention, case, dtype, ragged: bool) -> tuple[np.ndarray, np.ndarray]:
    """One step of `attention` over `case`'s caches stored in `dtype` (the step's new keys rounded as they are
    written): (its real rows' outputs, the reference's over the unrounded values)."""
    options = case["variant"].kwargs(case["case"][2] * case["case"][3])
    block_size, head_dim = case["case"][:2]
    step = make_step(case["case"], options, ragged)
    caches = (jnp.asarray(step.k_cache, dtype), jnp.asarray(step.v_cache, dtype))
    out, k_cache, _ = attention(jnp.array(step.q), jnp.array(step.k), jnp.array(step.v), *caches, jnp.int32(1),
                                step.metadata, block_size=block_size, scale=head_dim**-0.5, **options)
    assert k_cache.dtype == dtype
    return np.asarray(out)[step.real_rows], step.want


@pytest.mark.skipif(cpu.kernel_unavailable_reason() is not None, reason="no CPU kernel")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_both_cpu_backends_attend_over_the_rounded_cache_alike(dtype):
    """The xla path and the kernel, given one step over a 16- or 8-bit cache, agree to float32's order of
    summation; both differ from attention over the unrounded values."""
    outs = []
    for attention, ragged in ((xla.paged_attention, False), (cpu.paged_attention, True)):
        run = jax.jit(attention, static_argnames=("block_size", "scale", "sliding_window", "logits_soft_cap"))
        out, want = attend_over_a_narrow_cache(run, MIXED, dtype, ragged)
        assert np.abs(out - want).max() > 1e-4  # rounded: 8 bits of mantissa or fewer, not float32's 24
        outs.append(out)
    np.testing.assert_allclose(outs[0], outs[1], atol=2e-6)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("case", [MIXED, DECODE], ids=["ragged kernel", "decode kernel"])
def test_the_pallas_kernels_attend_over_an_8_bit_cache_as_xla_does(dtype, case):
    """In the interpreter: tests/test_cuda_lowering.py checks that Triton's lowering takes an 8-bit cache, and
    the GPU check (engine_greedy) runs it compiled."""
    outs = [attend_over_a_narrow_cache(attention, case, dtype, False)[0]
            for attention in (xla.paged_attention, pallas.make_backend("cpu"))]
    np.testing.assert_allclose(outs[0], outs[1], atol=2e-6)


def test_a_narrower_cache_holds_more_tokens_in_the_same_budget(make_llm):
    budget = dict(kv_cache_memory_bytes=64 << 20, max_model_len=256, max_num_seqs=2)
    plain, halved = make_llm(**budget).llm_engine, make_llm(kv_cache_dtype="bfloat16", **budget).llm_engine
    quartered = make_llm(kv_cache_dtype="fp8_e5m2", **budget).llm_engine
    assert plain.runner.k_cache.dtype == jnp.float32 and halved.runner.k_cache.dtype == jnp.bfloat16
    assert halved.runner.v_cache.dtype == halved.runner.host_v.dtype == jnp.bfloat16  # the swap pool too
    assert quartered.runner.v_cache.dtype == quartered.runner.host_v.dtype == jnp.float8_e5m2
    assert plain.dtype == halved.dtype == quartered.dtype == jnp.float32  # the weights and activations stay float32
    # 64 MiB / (64 tokens x 30 layers x K and V x 3 heads x 64 dims x 4, 2 or 1 bytes) = 22, 45 or 91 blocks.
    assert [e.stats()["num_blocks"] for e in (plain, halved, quartered)] == [22, 45, 91]


def test_fp8_is_vllms_e4m3():
    assert resolve_kv_cache_dtype("fp8", jnp.float32) == resolve_kv_cache_dtype("fp8_e4m3", jnp.float32)
    assert resolve_kv_cache_dtype("fp8", jnp.float32) == jnp.float8_e4m3fn


def test_8_bit_values_saturate_instead_of_overflowing():
    """Beyond an 8-bit float's largest finite value a cast gives NaN (e4m3) or infinity (e5m2); the cache keeps
    the largest value of the sign, as vLLM's fp8 cache does."""
    x = jnp.array([1000.0, -1e6, 3.0, 0.0])
    np.testing.assert_array_equal(xla.to_cache_dtype(x, jnp.float8_e4m3fn).astype(jnp.float32), [448, -448, 3, 0])
    np.testing.assert_array_equal(xla.to_cache_dtype(x, jnp.float8_e5m2).astype(jnp.float32), [1024, -57344, 3, 0])


def test_a_bfloat16_cache_scores_as_the_float32_one_to_its_rounding(llm, bf16_llm):
    token_ids = llm.get_tokenizer().encode(PROMPT)
    exact, rounded = prompt_logprobs(llm, token_ids), prompt_logprobs(bf16_llm, token_ids)
    # Rounding K and V to bfloat16 (8 bits of mantissa, relative error <= 2**-9) moves each attention output
    # by about that much, and the log-probabilities by a few hundredths at most over 30 layers; it moves them
    # (a cache that stayed float32 would not). Measured: at most ~0.01.
    moved = np.abs(rounded - exact)
    assert 0 < moved.max() < 0.05, moved.max()


def test_an_fp8_cache_scores_as_the_float32_one_to_its_rounding(llm, fp8_llm):
    token_ids = llm.get_tokenizer().encode(PROMPT)
    exact, rounded = prompt_logprobs(llm, token_ids), prompt_logprobs(fp8_llm, token_ids)
    # e4m3 keeps 4 bits of mantissa (relative error <= 2**-5, 16x bfloat16's): measured at most ~0.28 here and
    # ~0.06 on average, against bfloat16's 0.01. None of this prompt's keys or values comes near e4m3's 448.
    moved = np.abs(rounded - exact)
    assert 0 < moved.max() < 0.6 and moved.mean() < 0.15, (moved.max(), moved.mean())


@pytest.mark.parametrize("narrow", ["bf16_llm", "fp8_llm"])
def test_a_narrower_cache_generates_as_the_float32_one(llm, narrow, request):
    """Greedy decoding reads the cache at every step: the first tokens of the continuation are unchanged (with
    e5m2's 3 bits of mantissa the first token of this prompt, a close call, already changes: not tested)."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [want] = llm.generate([PROMPT], greedy, use_tqdm=False)
    [got] = request.getfixturevalue(narrow).generate([PROMPT], greedy, use_tqdm=False)
    assert got.outputs[0].text == want.outputs[0].text
