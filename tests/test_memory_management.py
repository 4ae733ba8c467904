"""Prefix caching, chunked prefill, preemption, parallel sampling, beam search and async scheduling on the real model.

The promise under test: none of them changes greedy or seeded output, and every block comes back.
"""

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_engine import BeamSearchParams, SamplingParams

SYSTEM = ("You are a careful assistant. Answer briefly and truthfully, and say when you do not know. "
          "Prefer plain words to jargon.")
PROMPTS = [SYSTEM + " Question: what is the capital of France?", SYSTEM + " Question: name a primary colour.",
           "Once upon a time", "def add(a, b):"]
PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=24, ignore_eos=True)] * 2
# Block counts below are sized for 16-token blocks: the shared 27-token system prompt fills one, 6 run short.
BASE = dict(max_model_len=96, max_num_seqs=8, block_size=16)


def assert_no_leak(llm):
    kv = llm.llm_engine.scheduler.kv
    for pool in (kv.device, kv.host):
        assert pool.num_free_blocks == pool.num_blocks and not any(pool.ref_cnt)
    assert not kv.block_tables and not llm.llm_engine.has_unfinished_requests()


def run(llm, prompts=PROMPTS, params=PARAMS):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leak(llm)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def baseline(make_llm):
    return run(make_llm(num_gpu_blocks_override=64, **BASE))


VARIANTS = {
    "recompute preemption (6 blocks)": dict(num_gpu_blocks_override=6, preemption_mode="recompute"),
    "swap preemption (6 blocks)": dict(num_gpu_blocks_override=6, preemption_mode="swap", swap_space=0.01),
    "prefix caching off": dict(num_gpu_blocks_override=64, enable_prefix_caching=False),
    "chunked prefill off": dict(num_gpu_blocks_override=64, enable_chunked_prefill=False),
    "chunks of 8 tokens": dict(num_gpu_blocks_override=64, max_num_batched_tokens=8),
    "chunks of 33 tokens": dict(num_gpu_blocks_override=64, max_num_batched_tokens=33),
    "block size 8": dict(num_gpu_blocks_override=128, block_size=8),
    "block size 32": dict(num_gpu_blocks_override=32, block_size=32),
    "block size 64 (the cpu backend's default)": dict(num_gpu_blocks_override=16, block_size=64),
    # Planning each step while the one before runs (jax_engine/async_scheduling.py), also under preemption.
    "async scheduling": dict(num_gpu_blocks_override=64, async_scheduling=True),
    "async scheduling, recompute preemption (6 blocks)": dict(num_gpu_blocks_override=6, async_scheduling=True),
    "async scheduling, swap preemption (6 blocks)": dict(num_gpu_blocks_override=6, preemption_mode="swap",
                                                         swap_space=0.01, async_scheduling=True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_and_seeded_output_is_invariant(make_llm, baseline, name):
    llm = make_llm(**{**BASE, **VARIANTS[name]})
    assert run(llm) == baseline
    if "preemption" in name:
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_output_does_not_depend_on_the_other_requests(make_llm, baseline):
    llm = make_llm(num_gpu_blocks_override=64, **BASE)
    alone = [run(llm, [p], [params])[0] for p, params in zip(PROMPTS, PARAMS)]
    assert alone == baseline


def test_preemptions_are_counted_and_logged_with_a_reason(make_llm, caplog):
    llm = make_llm(num_gpu_blocks_override=6, preemption_mode="swap", swap_space=0.01, **BASE)
    trace = llm.llm_engine.enable_trace()
    with caplog.at_level(logging.INFO, logger="jax_engine.core.scheduler"):
        run(llm)
    preempted = [p for step in trace for p in step.preempted]
    assert len(preempted) == llm.llm_engine.stats()["num_preemptions"] > 0
    assert all(mode == "swap" and "needed" in reason and "free" in reason for _, mode, reason in preempted)
    assert any("preempted" in m and "by swap" in m for m in caplog.messages)


def test_a_shared_system_prompt_skips_prefill_work(make_llm):
    llm = make_llm(num_gpu_blocks_override=64, **BASE)
    trace = llm.llm_engine.enable_trace()
    [first] = llm.generate(PROMPTS[0], PARAMS[0], use_tqdm=False)
    [second] = llm.generate(PROMPTS[1], PARAMS[0], use_tqdm=False)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 16  # one full block of the system prompt
    prefill = [step.scheduled[0][1] for step in trace if step.scheduled[0][1] > 1]
    assert prefill == [len(first.prompt_token_ids), len(second.prompt_token_ids) - 16]
    stats = llm.llm_engine.stats()
    assert stats["prefix_cache_hits"] == 16 and stats["prefix_cache_queries"] >= len(first.prompt_token_ids)
    [short] = llm.generate("Hi", PARAMS[0], use_tqdm=False)
    assert ("2", "prefix shorter than one block") in trace[-len(short.outputs[0].token_ids)].cache_misses


def test_reset_prefix_cache_forgets_cached_blocks_but_not_while_a_request_holds_blocks(make_llm):
    llm = make_llm(num_gpu_blocks_override=64, **BASE)
    [first] = llm.generate(PROMPTS[0], PARAMS[0], use_tqdm=False)
    [again] = llm.generate(PROMPTS[0], PARAMS[0], use_tqdm=False)
    assert again.num_cached_tokens > 0
    engine = llm.llm_engine
    engine.add_request("held", PROMPTS[0], PARAMS[0])
    engine.step()
    assert not llm.reset_prefix_cache()  # the running request's blocks stay cached
    engine.abort_request("held")
    assert llm.reset_prefix_cache() and engine.scheduler.kv.device.num_cached_blocks == 0
    [after] = llm.generate(PROMPTS[0], PARAMS[0], use_tqdm=False)
    assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_cache_salt_keeps_prefix_hits_among_requests_with_the_same_salt(make_llm):
    """vLLM's cache_salt: a tenant's cached blocks can be neither hit nor timed by another tenant."""
    llm = make_llm(num_gpu_blocks_override=64, **BASE)

    def generate(prompt: str, salt: str | None, params=PARAMS[0]):
        [output] = llm.generate({"prompt": prompt, "cache_salt": salt}, params, use_tqdm=False)
        return output

    first = generate(PROMPTS[0], "tenant-a")
    assert first.num_cached_tokens == 0
    assert generate(PROMPTS[1], "tenant-b").num_cached_tokens == 0  # the same system prompt, another salt
    unsalted = generate(PROMPTS[1], None)
    assert unsalted.num_cached_tokens == 0
    same_salt = generate(PROMPTS[1], "tenant-a")
    assert same_salt.num_cached_tokens == 16  # one full block of the shared system prompt
    assert same_salt.outputs[0].token_ids == unsalted.outputs[0].token_ids  # a salt never changes the output
    forked = generate(PROMPTS[1], "tenant-b", SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4))
    assert forked.num_cached_tokens == 32  # tenant b's earlier run of this prompt cached both its full blocks
    assert_no_leak(llm)


def test_chunked_prefill_mixes_chunks_with_decodes(make_llm):
    llm = make_llm(num_gpu_blocks_override=64, max_num_batched_tokens=8, **BASE)
    engine = llm.llm_engine
    trace = engine.enable_trace()
    engine.add_request("short", "Hi there", PARAMS[0])
    engine.step()  # "short" prefills, then decodes one token per step
    engine.add_request("long", PROMPTS[0], PARAMS[0])
    while engine.has_unfinished_requests():
        engine.step()
    mixed = [dict(step.scheduled) for step in trace if len(step.scheduled) == 2]
    assert any(m["short"] == 1 and 1 < m["long"] <= 7 for m in mixed)  # a decode and a chunk in one step
    assert all(sum(n for _, n in step.scheduled) <= 8 for step in trace)


def test_parallel_sampling_forks_the_prompt_and_matches_independent_seeds(make_llm):
    llm = make_llm(num_gpu_blocks_override=64, **BASE)
    trace = llm.llm_engine.enable_trace()
    params = SamplingParams(n=3, temperature=1.0, seed=10, max_tokens=12, ignore_eos=True)
    [together] = llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert_no_leak(llm)
    computed = sum(n for step in trace for _, n in step.scheduled)
    prompt_len = len(together.prompt_token_ids)
    assert computed == prompt_len + 3 * 11  # the prompt once, then one token per sample per step
    assert any(step.copies for step in trace)  # copy-on-write of the shared partial block
    for i, completion in enumerate(together.outputs):
        single = SamplingParams(temperature=1.0, seed=10 + i, max_tokens=12, ignore_eos=True)
        assert llm.reset_prefix_cache()  # prefill the whole prompt again, as `together` did: the same matmul path
        assert run(llm, [PROMPTS[0]], [single])[0] == completion.token_ids


def test_requests_that_will_fork_are_admitted_only_when_all_their_sequences_fit(make_llm):
    """n = 3 samples and 4 beams count as the rows they will take: two such requests run at once under
    max_num_seqs 8, and a full batch never forks past it into step shapes start-up did not compile."""
    llm = make_llm(num_gpu_blocks_override=64, **BASE)
    trace = llm.llm_engine.enable_trace()
    samples = llm.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert [len(o.outputs) for o in samples] == [3] * 4 and max(len(step.scheduled) for step in trace) == 6
    trace.clear()
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=4))
    assert [len(b.sequences) for b in beams] == [4] * 4 and max(len(step.scheduled) for step in trace) == 8
    assert_no_leak(llm)


def test_beam_search_shares_blocks_and_frees_pruned_beams(make_llm):
    llm = make_llm(**{**BASE, "num_gpu_blocks_override": 256, "block_size": 4})  # small blocks: beams share full ones
    [result] = llm.beam_search(PROMPTS[2], BeamSearchParams(beam_width=4, max_tokens=12))
    assert_no_leak(llm)
    scores = [s.cum_logprob / len(s.tokens) for s in result.sequences]
    assert len(result.sequences) == 4 and scores == sorted(scores, reverse=True)
    [greedy] = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, logprobs=0), use_tqdm=False)
    assert result.sequences[0].cum_logprob >= greedy.outputs[0].cumulative_logprob - 1e-4  # beams beat greedy
    assert llm.llm_engine.stats()["memory_saved_by_sharing"] > 0.3


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_equals_the_reference_beam_search(tiny_checkpoint, length_penalty):
    from jax_engine import LLM, EngineArgs, LLMEngine
    from reference import LlamaModel, beam_search

    llm = LLM.from_engine(LLMEngine(EngineArgs(num_gpu_blocks_override=64, block_size=4, max_model_len=64, enforce_eager=True),
                                    checkpoint=tiny_checkpoint))
    prompt = [256, 10, 20, 30, 40, 50]
    [ours] = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=7, length_penalty=length_penalty))
    expected = beam_search(LlamaModel(tiny_checkpoint.config, tiny_checkpoint.weights), prompt, 3, 7,
                           tiny_checkpoint.config.eos_token_ids, length_penalty)
    assert [s.tokens for s in ours.sequences] == [tokens for tokens, _ in expected]
    # The engine's float32 logprobs and the reference's NumPy ones agree to ~1e-5 per token on this tiny model,
    # as its logits do (test_engine_model_vs_hf.py); 7 tokens summed stay under 1e-4.
    np.testing.assert_allclose([s.cum_logprob for s in ours.sequences], [cum for _, cum in expected], atol=1e-4)
    assert_no_leak(llm)


@settings(max_examples=max(settings.default.max_examples // 7, 5))
@given(block_size=st.sampled_from([2, 4, 8]), spare_blocks=st.integers(0, 12), budget=st.integers(2, 40),
       chunked=st.booleans(), caching=st.booleans(), mode=st.sampled_from(["recompute", "swap"]),
       max_num_seqs=st.integers(1, 4), async_scheduling=st.booleans(),
       prompts=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=14), min_size=1, max_size=4))
def test_tiny_engine_output_is_invariant(tiny_checkpoint, block_size, spare_blocks, budget, chunked, caching, mode,
                                         max_num_seqs, async_scheduling, prompts):
    """The engine under random memory pressure and scheduling knobs gives the unconstrained engine's tokens."""
    from jax_engine import LLM, EngineArgs, LLMEngine

    def engine_output(**kwargs):
        llm = LLM.from_engine(LLMEngine(EngineArgs(max_model_len=24, enforce_eager=True, **kwargs), checkpoint=tiny_checkpoint))
        params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                  SamplingParams(temperature=1.0, seed=9, max_tokens=6, ignore_eos=True)]
        return run(llm, prompts, [params[i % 2] for i in range(len(prompts))])

    expected = engine_output(num_gpu_blocks_override=64, block_size=4)
    got = engine_output(num_gpu_blocks_override=-(-24 // block_size) + spare_blocks, block_size=block_size,
                        enable_chunked_prefill=chunked, max_num_batched_tokens=budget if chunked else 24,
                        enable_prefix_caching=caching, preemption_mode=mode, swap_space=0.001,
                        max_num_seqs=max_num_seqs, async_scheduling=async_scheduling)
    assert got == expected
