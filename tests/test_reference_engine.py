"""The reference engine end to end: the real model answers, bad input is refused, output is invariant."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference import LlamaModel, ReferenceEngine, SamplingParams, SchedulerConfig

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def make_engine(checkpoint, num_blocks=64, block_size=4, num_host_blocks=16, caching=True, **config):
    config.setdefault("max_model_len", 64)
    config.setdefault("max_num_batched_tokens", 64)
    return ReferenceEngine(LlamaModel(checkpoint.config, checkpoint.weights), num_blocks=num_blocks,
                           block_size=block_size, num_host_blocks=num_host_blocks, enable_prefix_caching=caching,
                           scheduler_config=SchedulerConfig(**config), eos_token_ids=checkpoint.config.eos_token_ids,
                           tokenizer=checkpoint.tokenizer)


def outputs(engine, prompts, params=GREEDY):
    generations = engine.generate(prompts, params)
    bm = engine.block_manager  # nothing leaks: every block is free again
    assert bm.device.num_free_blocks == bm.device.num_blocks and all(b.ref_cnt == 0 for b in bm.device.blocks)
    return [g.output_token_ids for g in generations]


def test_default_model_knows_the_capital_of_france(default_checkpoint):
    tokenizer = default_checkpoint.tokenizer
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    engine = make_engine(default_checkpoint, block_size=16, max_model_len=128, max_num_batched_tokens=128)
    [generation] = engine.generate([chat], SamplingParams(temperature=0, max_tokens=20))
    print(repr(generation.text))
    assert "Paris" in generation.text and generation.finish_reason == "stop"


# Prompts sharing a prefix, so prefix caching has something to hit.
PROMPTS = ["The cat sat on the mat and then", "The cat sat on the mat because", "Dogs bark", "The cat sat"]


def test_default_model_greedy_output_is_invariant_to_memory_management(default_checkpoint):
    """Preemption (both modes), chunked prefill, prefix caching and block size never change greedy text."""
    baseline = outputs(make_engine(default_checkpoint, block_size=16), PROMPTS)
    variants = {
        "recompute preemption": make_engine(default_checkpoint, num_blocks=6, preemption_mode="recompute"),
        "swap preemption": make_engine(default_checkpoint, num_blocks=6, preemption_mode="swap"),
        "chunked prefill": make_engine(default_checkpoint, enable_chunked_prefill=True, max_num_batched_tokens=5),
        "no prefix caching, block size 8": make_engine(default_checkpoint, block_size=8, caching=False),
    }
    for name, engine in variants.items():
        assert outputs(engine, PROMPTS) == baseline, name
    assert variants["recompute preemption"].scheduler.num_preemptions > 0
    assert variants["swap preemption"].scheduler.num_preemptions > 0
    assert any(out.swap_out for out in variants["swap preemption"].trace)


@given(
    block_size=st.sampled_from([1, 2, 4, 8]),
    spare_blocks=st.integers(0, 16),
    chunked=st.booleans(),
    budget=st.integers(1, 16),
    caching=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    max_num_seqs=st.integers(1, 4),
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=4),
)
def test_tiny_model_greedy_and_seeded_output_is_invariant(tiny_checkpoint, block_size, spare_blocks, chunked,
                                                           budget, caching, mode, max_num_seqs, prompts):
    params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=1.0, seed=7, max_tokens=6)]
    params = [params[i % 2] for i in range(len(prompts))]
    baseline = outputs(make_engine(tiny_checkpoint, num_blocks=64, max_model_len=32, max_num_batched_tokens=32,
                                   caching=False), prompts, params)
    longest = max(len(p) for p in prompts) + 6
    num_blocks = -(-longest // block_size) + spare_blocks  # the longest request fits; maybe nothing more
    engine = make_engine(tiny_checkpoint, num_blocks=num_blocks, block_size=block_size, caching=caching,
                         max_model_len=32, max_num_batched_tokens=budget if chunked else 32,
                         enable_chunked_prefill=chunked, preemption_mode=mode, max_num_seqs=max_num_seqs)
    assert outputs(engine, prompts, params) == baseline


def test_seeded_output_does_not_depend_on_the_batch(tiny_checkpoint):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=8)
    alone = outputs(make_engine(tiny_checkpoint), [[1, 2, 3]], seeded)
    crowd = outputs(make_engine(tiny_checkpoint), [[5, 6], [1, 2, 3], [7]],
                    [SamplingParams(temperature=1.0, max_tokens=8), seeded, GREEDY])
    assert crowd[1] == alone[0]
    other_seed = outputs(make_engine(tiny_checkpoint), [[1, 2, 3]], SamplingParams(temperature=1.0, seed=124, max_tokens=8))
    assert other_seed != alone  # a different stream (the vocabulary has 258 tokens)


def test_stop_token_ids_and_max_tokens(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    [free_run] = outputs(engine, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    [stopped] = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[free_run[2]]))
    assert stopped.output_token_ids == free_run[: free_run.index(free_run[2]) + 1]
    assert stopped.finish_reason == "stop"
    assert engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0].finish_reason == "length"


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 2.0), ("max_tokens", 0), ("allowed_token_ids", []), ("bad_words_token_ids", [[]]),
])
def test_sampling_params_out_of_range_name_the_field(field, value):
    # The oracle's plain range check; the engine's hardening of hostile input is in tests/test_input_checks.py.
    with pytest.raises(ValueError, match=f"{field} must be"):
        SamplingParams(**{field: value})


def test_tiny_positive_temperatures_are_raised_to_vllms_minimum():
    assert SamplingParams(temperature=1e-5).temperature == 0.01
    assert SamplingParams(temperature=0).greedy


def test_bad_prompts_name_the_field_and_limit(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, max_model_len=16, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.generate([[]])
    with pytest.raises(ValueError, match=r"\[0, vocab_size=258\)"):
        engine.generate([[1, 258]])
    with pytest.raises(ValueError, match="exceeds max_model_len=16"):
        engine.generate([list(range(20))], GREEDY)
    with pytest.raises(ValueError, match="exceeds max_model_len=16"):  # no room for even one token
        engine.generate([list(range(16))], SamplingParams(max_tokens=None))
    [until_limit] = engine.generate([list(range(10))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(until_limit.output_token_ids) == 6 and until_limit.finish_reason == "length"
    # A bad prompt in a batch leaves nothing queued behind it.
    with pytest.raises(ValueError):
        engine.generate([[1, 2], [-1]])
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.device.num_free_blocks == engine.block_manager.device.num_blocks
