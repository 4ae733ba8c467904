"""vLLM's token controls through LLM.generate on the default model: logit_bias, allowed_token_ids, bad_words,
truncate_prompt_tokens."""

import pytest

from jax_engine import SamplingParams

PROMPT = "The capital of France is"


def greedy(llm, prompt=PROMPT, **controls) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **controls)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_logit_bias_forces_and_forbids_tokens(llm):
    plain = greedy(llm)
    forced = llm.get_tokenizer().encode(" Lyon", add_special_tokens=False)[0]
    assert greedy(llm, logit_bias={forced: 100.0}) == [forced] * 8
    banned = greedy(llm, logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0]


def test_allowed_token_ids_restrict_every_token(llm):
    allowed = llm.get_tokenizer().encode(" yes no maybe", add_special_tokens=False)
    assert set(greedy(llm, allowed_token_ids=allowed)) <= set(allowed)


def test_bad_words_never_appear(llm):
    tokenizer = llm.get_tokenizer()
    plain = tokenizer.decode(greedy(llm))
    assert "Paris" in plain
    text = tokenizer.decode(greedy(llm, bad_words=["Paris"]))
    assert "Paris" not in text and text != plain


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = llm.get_tokenizer().encode("Once upon a time, in a land far away, " + PROMPT)
    assert greedy(llm, {"prompt_token_ids": ids}, truncate_prompt_tokens=6) == \
        greedy(llm, {"prompt_token_ids": ids[-6:]})


def test_controls_out_of_the_vocabulary_are_refused(llm):
    for controls, field in (({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
                            ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
                            ({"bad_words_token_ids": [[10**6]]}, "bad_words_token_ids")):
        with pytest.raises(ValueError, match=field):
            greedy(llm, **controls)


def test_the_callers_params_are_left_as_they_were(llm):
    """The engine keeps what it derives from a request's params (the bad words in token ids, the allowed-token
    mask, the compiled grammar) on its own copy: the caller's object may be reused, or sent to another engine
    with another tokenizer."""
    allowed = llm.get_tokenizer().encode(" yes no maybe Paris", add_special_tokens=False)
    controls = SamplingParams(temperature=0, max_tokens=4, bad_words=["Paris"], allowed_token_ids=allowed)
    grammar = SamplingParams(temperature=0, max_tokens=4, structured_outputs={"choice": ["yes", "no"]})
    before = {id(p): dict(vars(p)) for p in (controls, grammar)}
    _, _, engine_params = llm.llm_engine.validate_request(PROMPT, controls)
    assert engine_params is not controls
    assert engine_params.bad_words_token_ids and engine_params.allowed_mask is not None
    outputs = llm.generate([PROMPT, PROMPT], [controls, grammar], use_tqdm=False)
    assert "Paris" not in outputs[0].outputs[0].text and outputs[1].outputs[0].text in ("yes", "no")
    for params in (controls, grammar):
        assert vars(params) == before[id(params)]
        assert params.compiled_grammar is None and params.allowed_mask is None and params.bad_words_token_ids == ()
