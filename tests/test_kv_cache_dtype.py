"""kv_cache_dtype (vLLM's flag): keys and values stored in bfloat16 beside the float32 default model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_engine import SamplingParams
from jax_engine.attention import cpu, xla
from tests.conftest import LLM_ARGS
from tests.test_attention_backends import MIXED, make_step

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
SCORE = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)


def prompt_logprobs(llm, token_ids: list[int]) -> np.ndarray:
    """The log-probability of each prompt token after the ones before it."""
    [out] = llm.generate([token_ids], SCORE, use_tqdm=False)
    return np.array([step[token].logprob for step, token in zip(out.prompt_logprobs[1:], token_ids[1:])])


@pytest.fixture(scope="module")
def bf16_llm(make_llm):
    return make_llm(**dict(LLM_ARGS, kv_cache_dtype="bfloat16"))


@pytest.mark.skipif(cpu.kernel_unavailable_reason() is not None, reason="no CPU kernel")
def test_both_cpu_backends_attend_over_the_rounded_cache_alike():
    """The xla path and the kernel, given one step over a bfloat16 cache (its new keys rounded as they are
    written), agree to float32's order of summation; both differ from attention over the unrounded values."""
    options = MIXED["variant"].kwargs(MIXED["case"][2] * MIXED["case"][3])
    block_size, head_dim = MIXED["case"][:2]
    outs = []
    for attention, ragged in ((xla.paged_attention, False), (cpu.paged_attention, True)):
        step = make_step(MIXED["case"], options, ragged)
        run = jax.jit(attention, static_argnames=("block_size", "scale", "sliding_window", "logits_soft_cap"))
        caches = (jnp.asarray(step.k_cache, jnp.bfloat16), jnp.asarray(step.v_cache, jnp.bfloat16))
        out, k_cache, _ = run(jnp.array(step.q), jnp.array(step.k), jnp.array(step.v), *caches, jnp.int32(1),
                              step.metadata, block_size=block_size, scale=head_dim**-0.5, **options)
        assert k_cache.dtype == jnp.bfloat16
        outs.append(np.asarray(out)[step.real_rows])
        assert np.abs(outs[-1] - step.want).max() > 1e-4  # rounded: 8 bits of mantissa, not float32's 24
    np.testing.assert_allclose(outs[0], outs[1], atol=2e-6)


def test_a_bfloat16_cache_holds_twice_the_tokens_in_the_same_budget(make_llm):
    budget = dict(kv_cache_memory_bytes=64 << 20, max_model_len=256, max_num_seqs=2)
    plain, halved = make_llm(**budget).llm_engine, make_llm(kv_cache_dtype="bfloat16", **budget).llm_engine
    assert plain.runner.k_cache.dtype == jnp.float32 and halved.runner.k_cache.dtype == jnp.bfloat16
    assert halved.runner.v_cache.dtype == halved.runner.host_v.dtype == jnp.bfloat16  # the swap pool too
    assert plain.dtype == halved.dtype == jnp.float32  # the weights and activations stay float32
    # 64 MiB / (64 tokens x 30 layers x K and V x 3 heads x 64 dims x 4 or 2 bytes) = 22 or 45 blocks.
    assert (plain.stats()["num_blocks"], halved.stats()["num_blocks"]) == (22, 45)


def test_a_bfloat16_cache_scores_as_the_float32_one_to_its_rounding(llm, bf16_llm):
    token_ids = llm.get_tokenizer().encode(PROMPT)
    exact, rounded = prompt_logprobs(llm, token_ids), prompt_logprobs(bf16_llm, token_ids)
    # Rounding K and V to bfloat16 (8 bits of mantissa, relative error <= 2**-9) moves each attention output
    # by about that much, and the log-probabilities by a few hundredths at most over 30 layers; it moves them
    # (a cache that stayed float32 would not). Measured: at most ~0.01.
    moved = np.abs(rounded - exact)
    assert 0 < moved.max() < 0.05, moved.max()


def test_a_bfloat16_cache_generates_as_the_float32_one(llm, bf16_llm):
    """Greedy decoding reads the cache at every step: the first tokens of the continuation are unchanged."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [want] = llm.generate([PROMPT], greedy, use_tqdm=False)
    [got] = bf16_llm.generate([PROMPT], greedy, use_tqdm=False)
    assert got.outputs[0].text == want.outputs[0].text
