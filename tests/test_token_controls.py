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
