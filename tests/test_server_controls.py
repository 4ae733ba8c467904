"""The token controls and prompt scoring over HTTP, with the official openai client: logit_bias (OpenAI's
string keys), allowed_token_ids, bad_words, truncate_prompt_tokens, prompt_logprobs, and echo with
max_tokens=0 (how lm-eval scores multiple-choice answers)."""

import numpy as np
import openai
import pytest

from jax_engine import SamplingParams
from tests.server_helpers import TINY_ENGINE_ARGS, cli_flags, start_server_process, stop_server_process

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
ENGINE = {**TINY_ENGINE_ARGS, "num_gpu_blocks_override": 64}


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("server") / "server.log"


@pytest.fixture(scope="module")
def client(server_log):
    process, url = start_server_process(*cli_flags(**ENGINE), log_path=str(server_log))
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    stop_server_process(process)
    assert "Traceback" not in server_log.read_text(), server_log.read_text()[-3000:]


def complete(client, **fields):
    standard = {k: fields.pop(k) for k in ("max_tokens", "logit_bias", "echo", "logprobs") if k in fields}
    return client.completions.create(model=MODEL, prompt=fields.pop("prompt", PROMPT), temperature=0,
                                     **{"max_tokens": 8, **standard}, extra_body=fields)


def test_logit_bias_with_string_keys(client, llm):
    forced = llm.get_tokenizer().encode(" Lyon", add_special_tokens=False)[0]
    text = complete(client, logit_bias={str(forced): 100}).choices[0].text
    assert text == " Lyon" * 8


def test_allowed_tokens_and_bad_words(client, llm):
    tokenizer = llm.get_tokenizer()
    allowed = tokenizer.encode(" yes no", add_special_tokens=False)
    text = complete(client, allowed_token_ids=allowed).choices[0].text
    assert set(tokenizer.encode(text, add_special_tokens=False)) <= set(allowed)
    assert "Paris" in complete(client).choices[0].text
    assert "Paris" not in complete(client, bad_words=["Paris"]).choices[0].text


def test_truncate_prompt_tokens(client, llm):
    ids = llm.get_tokenizer().encode("Once upon a time, far away. " + PROMPT)
    assert complete(client, prompt=ids, truncate_prompt_tokens=5).choices[0].text == \
        complete(client, prompt=ids[-5:]).choices[0].text


def test_echo_with_max_tokens_0_scores_the_prompt(client, llm):
    """lm-eval's loglikelihood request: the prompt back, with the logprob of each of its tokens given the ones
    before (None for the first), equal to what the engine's prompt_logprobs computes."""
    answer = complete(client, max_tokens=0, echo=True, logprobs=1)
    choice = answer.choices[0]
    ids = llm.get_tokenizer().encode(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == len(ids)
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(ids)
    assert "".join(choice.logprobs.tokens) == PROMPT
    expected = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                            use_tqdm=False)[0].prompt_logprobs
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], [e[t].logprob for t, e in zip(ids[1:], expected[1:])],
                               atol=1e-4)


def test_echo_with_logprobs_puts_the_prompts_before_the_text(client):
    choice = complete(client, echo=True, logprobs=0, max_tokens=4).choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert choice.logprobs.token_logprobs[0] is None
    assert "".join(choice.logprobs.tokens) == choice.text


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(client):
    """vLLM's field: every token of logprobs (and of their top alternatives) is token_id:N, with the same log
    probabilities; the text offsets follow those names, as vLLM's do."""
    plain = complete(client, logprobs=2, return_token_ids=True).choices[0]
    named = complete(client, logprobs=2, return_token_ids=True, return_tokens_as_token_ids=True).choices[0]
    ids = named.model_extra["token_ids"]
    assert named.logprobs.tokens == [f"token_id:{t}" for t in ids] and named.text == plain.text
    assert named.logprobs.token_logprobs == plain.logprobs.token_logprobs
    assert all(key.startswith("token_id:") for top in named.logprobs.top_logprobs for key in top)
    assert named.logprobs.text_offset[1] == len(f"token_id:{ids[0]}")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert all(c.token.startswith("token_id:") and bytes(c.bytes).decode() == c.token
               and all(top.token.startswith("token_id:") for top in c.top_logprobs) for c in chat.logprobs.content)


def test_prompt_logprobs_field(client):
    choice = complete(client, prompt_logprobs=2, max_tokens=2).choices[0]
    entries = choice.model_extra["prompt_logprobs"]
    assert entries[0] is None and all(1 <= len(e) <= 3 for e in entries[1:])


def test_bad_values_are_400s_naming_the_field(client):
    for fields, name in (({"max_tokens": 0}, "max_tokens"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
                         ({"logit_bias": {"5": 101}}, "logit_bias"), ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
                         ({"allowed_token_ids": []}, "allowed_token_ids"), ({"truncate_prompt_tokens": -2}, "truncate")):
        with pytest.raises(openai.BadRequestError, match=name):
            complete(client, **fields)
    assert complete(client).choices[0].text  # still serving


def _openai_fields(module) -> list[str]:
    return sorted(module.CompletionCreateParamsBase.__annotations__)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_field_of_openais_schema_is_honoured_refused_or_warned(client, server_log, endpoint):
    """Each field of the official client's request type, sent with a value of its type: the server either
    implements it (a declared field), or answers 400 naming it, or accepts it with a warning (IGNORED_FIELDS)."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    from jax_engine.server.protocol import IGNORED_FIELDS, ChatCompletionRequest, CompletionRequest

    module, request = ((completion_create_params, CompletionRequest) if endpoint == "completions"
                       else (chat_create_params, ChatCompletionRequest))
    http = client._client
    url = f"{client.base_url}{'completions' if endpoint == 'completions' else 'chat/completions'}"
    body = ({"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    refused = []
    for name in _openai_fields(module):
        if name in request.model_fields:
            continue  # implemented; the other tests use them
        reply = http.post(url, json={**body, "max_tokens": 2, name: SAMPLE_VALUES.get(name, {"x": 1})})
        if name in IGNORED_FIELDS:
            assert reply.status_code == 200, (name, reply.text)
        else:
            assert reply.status_code == 400, (name, reply.text)
            error = reply.json()["error"]
            assert error["param"] == name and name in error["message"]
            refused.append(name)
    assert ("best_of" in refused) if endpoint == "completions" else {"functions", "audio"} <= set(refused)
    if endpoint == "chat":  # "store" sent twice: one warning
        assert http.post(url, json={**body, "max_tokens": 2, "store": True}).status_code == 200
        assert server_log.read_text().count("request field 'store' is accepted and ignored") == 1


# Values of the right type for OpenAI's fields (the server must refuse or ignore them whatever they are).
SAMPLE_VALUES = {"best_of": 2, "suffix": "x", "store": True, "metadata": {"a": "b"}, "service_tier": "auto",
                 "parallel_tool_calls": True, "response_format": {"type": "json_object"}, "reasoning_effort": "low",
                 "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
                 "modalities": ["text"], "verbosity": "low", "prompt_cache_key": "k", "safety_identifier": "s"}


def test_unknown_fields_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="guided_whitespace_pattern is not supported"):
        complete(client, guided_whitespace_pattern=r"\s*")
