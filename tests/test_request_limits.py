"""No request can break the engine: arbitrary SamplingParams values either fail at once with a ValueError
naming the field, or run to a normal finish; either way the engine goes on serving everyone else.

And when a request's own host-side work does fail anyway (a validation gap, a bug), it fails alone.
"""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_engine import EngineArgs, LLMEngine, SamplingParams
from jax_engine.beam_search import BeamSearchParams

# max_logprobs one below the most the sampler keeps, so that vLLM's limit is seen refusing 20.
ARGS = dict(num_gpu_blocks_override=32, block_size=8, max_model_len=48, max_num_seqs=4, max_num_batched_tokens=48,
            enforce_eager=True, max_logprobs=19)
PROMPT = [5, 6, 7, 8]
NORMAL = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]

# A valid request (every field set to an ordinary value), then up to three fields replaced by what a careless
# or hostile caller might pass: the edges of the integer types the sampler packs, floats that overflow or
# vanish in float32, wrong types that Python would happily coerce.
VALID = st.fixed_dictionaries({
    "n": st.integers(1, 3), "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.5]), "top_p": st.floats(0.1, 1),
    "top_k": st.sampled_from([-1, 0, 1, 5, 258]), "min_p": st.sampled_from([0.0, 0.05, 0.5]),
    "seed": st.one_of(st.none(), st.integers(0, 2**32)), "max_tokens": st.integers(1, 8),
    "stop_token_ids": st.lists(st.integers(0, 257), max_size=3), "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "min_tokens": st.integers(0, 1), "logprobs": st.one_of(st.none(), st.integers(0, 5)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 2)), "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.integers(0, 257), st.floats(-100, 100), max_size=3)),
    "allowed_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 257), min_size=1, max_size=4)),
    "bad_words_token_ids": st.lists(st.lists(st.integers(0, 257), min_size=1, max_size=2), max_size=2),
    "bad_words": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "truncate_prompt_tokens": st.one_of(st.none(), st.just(-1), st.integers(1, 6)),
    "structured_outputs": st.sampled_from([None, {"regex": "[a-c]{1,4}"}, {"choice": ["ab", "c"]},
                                           {"json": {"type": "array", "items": {"type": "integer"}}},
                                           {"grammar": 'start: "x"+'}, {"json_object": True}])})
EXTREME_INTS = [-(2**63) - 1, -(2**63), -(2**31) - 1, -2, -1, 0, 1, 2, 257, 258, 259, 2**31 - 1, 2**31, 2**32,
                2**63, 2**64, 10**400]
EXTREME_FLOATS = [float("nan"), float("inf"), -float("inf"), -1.0, -0.0, 1e-300, 1e-45, 1e-5, 0.5, 1e30, 3.5e38,
                  1e300]
ODD = [None, True, False, "5", "", [], ["a"], {"a": 1}, 1.5]
EXTREMES = {name: EXTREME_INTS + ODD
            for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")}
EXTREMES |= {name: EXTREME_FLOATS + EXTREME_INTS + ODD
             for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")}
EXTREMES |= {name: ODD for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")}
EXTREMES["stop_token_ids"] = ODD + [[value] for value in EXTREME_INTS + ODD]
EXTREMES["stop"] = ODD + [[value] for value in ODD] + [["x"] * 100, ["x" * 2000]]
EXTREMES["truncate_prompt_tokens"] = EXTREME_INTS + ODD
EXTREMES["logit_bias"] = ODD + [{value: 1.0} for value in EXTREME_INTS + ODD[:3]] + [
    {0: value} for value in EXTREME_FLOATS + ODD] + [{i: 1.0 for i in range(301)}]
EXTREMES["allowed_token_ids"] = ODD + [[value] for value in EXTREME_INTS + ODD] + [list(range(258)) * 2]
EXTREMES["bad_words_token_ids"] = ODD + [[value] for value in ODD] + [[[value]] for value in EXTREME_INTS + ODD]
EXTREMES["bad_words"] = ODD + [[value] for value in ODD] + [["x"] * 300, ["x" * 2000]]
EXTREMES["structured_outputs"] = ODD + [{kind: value} for kind in ("json", "regex", "choice", "grammar", "json_object")
                                        for value in ODD + ["(", "x" * (2**20 + 1), [""], [1]]]
assert set(EXTREMES) == set(FIELDS), "a new SamplingParams field needs its values here"


@st.composite
def sampling_kwargs(draw) -> dict:
    kwargs = draw(VALID)
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        kwargs[name] = draw(st.sampled_from(EXTREMES[name]))
    return kwargs


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> LLMEngine:
    return LLMEngine(EngineArgs(**ARGS), checkpoint=tiny_checkpoint)


def _run(engine: LLMEngine, request_id: str, params, prompt=PROMPT):
    engine.add_request(request_id, prompt, params)
    final = None
    for _ in range(200):
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                final = output
        if final is not None:
            return final
    raise AssertionError(f"{request_id} did not finish in 200 steps")


def _refused_at_once_or_finishes(engine: LLMEngine, kwargs: dict) -> None:
    try:
        params = SamplingParams(**kwargs)
        output = _run(engine, "arbitrary", params)
    except ValueError as error:  # at construction or at add time, never inside step()
        # It names the field (a nested one by its path: structured_outputs.json).
        assert str(error).split()[0].split(".")[0] in [*kwargs, "prompt"], error
        assert not engine.has_unfinished_requests()
    else:
        vocab = engine.model_config.vocab_size
        for completion in output.outputs:
            assert completion.finish_reason in ("stop", "length"), (kwargs, completion)
            assert all(0 <= t < vocab for t in completion.token_ids)
    kv = engine.scheduler.kv
    assert kv.device.num_free_blocks == kv.device.num_blocks


@pytest.fixture(scope="module")
def normal_tokens(engine) -> list[int]:
    return _run(engine, "normal", NORMAL).outputs[0].token_ids


# Half the profile's examples: each one runs requests on the engine (50 in `ci`, 250 in `thorough`).
@settings(max_examples=settings.default.max_examples // 2)
@given(kwargs=sampling_kwargs())
def test_arbitrary_sampling_params_fail_at_once_or_finish(engine, normal_tokens, kwargs):
    _refused_at_once_or_finishes(engine, kwargs)
    assert _run(engine, "after", NORMAL).outputs[0].token_ids == normal_tokens


def test_every_extreme_value_of_every_field_fails_at_once_or_finishes(engine, normal_tokens):
    """The sweep that random combinations may miss: each field alone at each of its extreme values."""
    for name, values in EXTREMES.items():
        for value in values:
            _refused_at_once_or_finishes(engine, {"temperature": 1.0, "max_tokens": 3, name: value})
    assert _run(engine, "after", NORMAL).outputs[0].token_ids == normal_tokens


@pytest.mark.parametrize("kwargs, field", [
    (dict(top_k=2**31), "top_k"),  # overflowed np.int32 inside the sampler once, killing the server
    (dict(top_k=259), "top_k"),  # above the tiny model's vocabulary
    (dict(min_tokens=2, stop_token_ids=[2**31]), "stop_token_ids"),
    (dict(stop_token_ids=[258]), "stop_token_ids"),
    (dict(n=5), "n"),  # more sequences than max_num_seqs: could never run in one batch
    (dict(max_tokens=None, min_tokens=45), "min_tokens"),  # more than max_model_len leaves room for
    (dict(temperature=10**401), "temperature"),
    (dict(seed=2**64), "seed"),
    (dict(n=True), "n"),
    (dict(max_tokens="5"), "max_tokens"),
    (dict(stop=["x"] * 10_000), "stop"),
    (dict(stop=["x" * 2000]), "stop"),
    (dict(repetition_penalty=1e-30), "repetition_penalty"),
    (dict(logprobs=20), "logprobs"),  # more than max_logprobs
    (dict(prompt_logprobs=20), "prompt_logprobs"),
])
def test_known_bad_values_are_refused_with_the_field_named(engine, kwargs, field):
    with pytest.raises(ValueError) as refused:
        engine.add_request("bad", PROMPT, SamplingParams(**kwargs))
    assert str(refused.value).startswith(field), refused.value
    assert len(str(refused.value)) < 300  # a 10,000-string list is not echoed back whole
    assert not engine.has_unfinished_requests()


def test_bad_prompts_and_beam_params_are_refused(engine):
    for prompt, field in (([True, False], "prompt"), ("a\ud800b", "prompt"), ({"prompt": "a", "cache_salt": ""},
                                                                             "cache_salt")):
        with pytest.raises(ValueError, match=f"^{field}"):
            engine.add_request("bad", prompt, NORMAL)
    with pytest.raises(ValueError, match="^beam_width"):
        engine.add_request("bad", PROMPT, BeamSearchParams(beam_width=5, max_tokens=4))
    with pytest.raises(ValueError, match="^length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=10**400)


def test_text_too_long_to_fit_is_refused_by_its_length_and_truncation_keeps_the_whole_texts_tokens(engine):
    """The tiny byte-level tokenizer's longest entry is 12 characters, so no text of more than 2 x 48 x 12
    characters fits max_model_len=48: it is refused before it is tokenized, naming the limit. With
    truncate_prompt_tokens such text is cut to that many last characters first, and the tokens kept are the ones
    the whole text gives."""
    processor, tokenizer = engine.input_processor, engine.tokenizer
    assert processor.max_prompt_chars == 2 * 48 * max(map(len, tokenizer.get_vocab())) == 1152
    text = "a few words, then more; " * 1000  # 24,000 characters
    with pytest.raises(ValueError, match=r"^prompt must be text of at most 1152 characters \(no longer text fits "
                                         r"max_model_len=48 tokens\), got 24000$"):
        engine.add_request("long", text, NORMAL)
    truncated = dataclasses.replace(NORMAL, truncate_prompt_tokens=40)
    _, token_ids, _ = processor.process(text, truncated)
    assert token_ids == tokenizer.encode(text)[-40:]


def test_tiny_positive_temperatures_are_raised_to_vllms_minimum():
    assert SamplingParams(temperature=1e-300).temperature == 0.01
    assert SamplingParams(temperature=0).greedy


def _poison(engine: LLMEngine, request_id: str) -> None:
    """Make a queued request's sampling row impossible to pack, as top_k=2**31 once was (validation gap)."""
    params = engine._groups[request_id].params
    object.__setattr__(params, "top_k", 2**31)


@pytest.mark.parametrize("n", [1, 3])
def test_a_request_whose_row_cannot_be_packed_fails_alone(engine, n):
    alone = _run(engine, "alone", NORMAL)
    engine.add_request("poisoned", PROMPT, SamplingParams(temperature=1.0, max_tokens=8, n=n))
    _poison(engine, "poisoned")
    finals = {}
    engine.add_request("healthy", PROMPT, NORMAL)
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert [c.finish_reason for c in finals["poisoned"].outputs] == ["error"] * n
    assert finals["healthy"].outputs[0].token_ids == alone.outputs[0].token_ids
    kv = engine.scheduler.kv
    assert kv.device.num_free_blocks == kv.device.num_blocks


def test_a_request_whose_output_processing_raises_fails_alone(engine, monkeypatch):
    """A fault in one request's token bookkeeping (detokenizer, stop strings, logprobs) fails only it."""
    alone = _run(engine, "alone", NORMAL)
    process_token = engine.output_processor.process_token

    def faulty(seq, sampled, *rest):
        if seq.request_id == "faulty" and seq.num_output_tokens == 3:
            raise RuntimeError("injected fault")
        return process_token(seq, sampled, *rest)

    monkeypatch.setattr(engine.output_processor, "process_token", faulty)
    engine.add_request("faulty", PROMPT, NORMAL)
    engine.add_request("healthy", PROMPT, NORMAL)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["faulty"].outputs[0].finish_reason == "error"
    # The scheduler appended the third token; its text and logprobs (the output processor's part) failed.
    assert len(finals["faulty"].outputs[0].token_ids) == 3
    assert finals["healthy"].outputs[0].token_ids == alone.outputs[0].token_ids
    assert engine.scheduler.kv.device.num_free_blocks == engine.scheduler.kv.device.num_blocks
