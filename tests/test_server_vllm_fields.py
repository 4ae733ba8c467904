"""vLLM's answer fields and switches over HTTP, with the official openai client, on a tiny random model whose output
a regex (structured_outputs) makes known: chat_template_kwargs, --reasoning-parser's reasoning_content (streamed
and not), stop_reason, usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details), /version,
--chat-template and continue_final_message, the periodic stats line, several served names, use_beam_search,
request_id and X-Request-Id, --chat-template-content-format, a model named by its hub id (--download-dir,
--revision)."""

import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from jax_engine.chat_template import load_chat_template
from jax_engine.server.server_config import LOG_STATS_INTERVAL_ENV
from tests.server_helpers import cli_flags, start_server_process, stop_server_process, wait_for
from tests.tiny_checkpoints import snapshot_in_hub_cache

ENGINE = {"num_gpu_blocks_override": 64, "block_size": 8, "max_model_len": 128, "max_num_seqs": 4,
          "max_num_batched_tokens": 64, "enforce_eager": True}
THINKING = "<think>" + "abc de" + "</think>" + "the answer"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("server") / "server.log"


@pytest.fixture(scope="module")
def server(tiny_checkpoint_dir, server_log, tmp_path_factory):
    """The tiny model served by a hub name, as vLLM's command lines give it: from a Hugging Face cache
    (--download-dir) holding it at tag v1 only, so the engine core must be given --revision to find it."""
    log, cache = server_log, tmp_path_factory.mktemp("hub-cache")
    snapshot_in_hub_cache(cache, "org/tiny", tiny_checkpoint_dir, refs=("v1",))
    process, url = start_server_process("org/tiny", "--download-dir", str(cache), "--revision", "v1",
                                        *cli_flags(**ENGINE), "--reasoning-parser", "qwen3",
                                        "--enable-prompt-tokens-details", "--served-model-name", "tiny", "tiny-2",
                                        "--enable-request-id-headers",
                                        log_path=str(log), env={LOG_STATS_INTERVAL_ENV: "0.5"})
    yield url
    stop_server_process(process)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def forced_chat(client, text: str, **fields):
    """A chat answer the tiny model is made to write: exactly `text` (a regex of it), then the end token."""
    stream = fields.pop("stream", False)
    return client.chat.completions.create(model="tiny", messages=HELLO, temperature=0, max_tokens=40, stream=stream,
                                          extra_body={"structured_outputs": {"regex": text}, **fields})


def test_reasoning_content_is_split_from_the_answer(client):
    answer = forced_chat(client, THINKING).choices[0].message
    assert answer.model_extra["reasoning_content"] == "abc de" and answer.content == "the answer"
    chunks = list(forced_chat(client, THINKING, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "abc de"
    assert "".join(d.content or "" for d in deltas) == "the answer"
    held = [c for c in chunks[1:] if not (c.choices[0].delta.content or c.choices[0].finish_reason
                                           or c.choices[0].delta.model_extra.get("reasoning_content"))]
    assert not held  # while a tag might be beginning, nothing is sent (an empty delta a token, before)
    plain = forced_chat(client, "no thinking here").choices[0].message  # qwen3: no <think>, all content
    assert plain.content == "no thinking here" and plain.model_extra["reasoning_content"] is None


def test_chat_template_kwargs_reach_the_template(client):
    """The tiny template writes Qwen3's empty thinking part when enable_thinking is false: 17 more prompt tokens
    (one a byte); apply_chat_template's own arguments are refused, naming the field."""
    counts = [forced_chat(client, "ok", **extra).usage.prompt_tokens
              for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}})]
    assert counts[1] - counts[0] == len("<think>\n\n</think>\n\n")
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set 'tokenize'") as error:
        forced_chat(client, "ok", chat_template_kwargs={"tokenize": True})
    assert error.value.body["param"] == "chat_template_kwargs"


def test_text_parts_are_joined_with_newlines_for_a_template_that_prints_content(server, client, tiny_checkpoint):
    """The tiny template prints a message's content, so (--chat-template-content-format auto) a list of text
    parts reaches it joined with newlines, as vLLM joins them: in /tokenize and in a chat."""
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    joined = [{"role": "system", "content": "Be\nbrief."}, {"role": "user", "content": "Hel\nlo"}]
    tokens = [httpx.post(f"{server}/tokenize", json={"messages": m}).json()["tokens"] for m in (parts, joined)]
    assert tokens[0] == tokens[1] and "Hel\nlo" in tiny_checkpoint.tokenizer.decode(tokens[0])
    counts = [client.chat.completions.create(model="tiny", messages=m, max_tokens=1).usage.prompt_tokens
              for m in (parts, joined)]
    assert counts == [len(tokens[0])] * 2


def test_stop_reason_names_what_stopped_the_answer(client, tiny_checkpoint):
    """A stop string, a stop token id, and the end-of-sequence token (None, as vLLM)."""
    e = tiny_checkpoint.tokenizer.convert_tokens_to_ids("e")
    cut = client.completions.create(model="tiny", prompt="x", max_tokens=20, temperature=0, stop=["ef"],
                                    extra_body={"structured_outputs": {"regex": "abcdefgh"}})
    assert cut.choices[0].text == "abcd" and cut.choices[0].model_extra["stop_reason"] == "ef"
    by_token = forced_chat(client, "abcdefgh", stop_token_ids=[e]).choices[0]
    assert by_token.finish_reason == "stop" and by_token.model_extra["stop_reason"] == e
    ended = forced_chat(client, "abc").choices[0]
    assert ended.finish_reason == "stop" and ended.model_extra["stop_reason"] is None
    streamed = [c.choices[0] for c in forced_chat(client, "abcdefgh", stream=True, stop=["ef"]) if c.choices]
    assert streamed[-1].finish_reason == "stop" and streamed[-1].model_extra["stop_reason"] == "ef"


def test_usage_reports_prompt_tokens_found_in_the_prefix_cache(client):
    prompt = "a prompt long enough to fill a few blocks of eight tokens"
    first, second = (client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0).usage
                     for _ in range(2))
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == (first.prompt_tokens - 1) // 8 * 8  # whole blocks


def test_version(server):
    assert httpx.get(f"{server}/version").json() == {"version": "0.1.0"}


def test_a_server_without_a_tokenizer_answers_in_token_ids(bare_checkpoint_dir, client, tmp_path):
    """--skip-tokenizer-init over a checkpoint without tokenizer files: token-id prompts get the same token ids as
    the server with the tokenizer (return_token_ids); what needs text is a 400 naming its field."""
    prompt, greedy = [5, 17, 42, 99, 3], {"max_tokens": 5, "temperature": 0, "extra_body": {"return_token_ids": True,
                                                                                           "ignore_eos": True}}
    expected = client.completions.create(model="tiny", prompt=prompt, **greedy).choices[0]
    process, url = start_server_process(bare_checkpoint_dir, *cli_flags(**ENGINE), "--skip-tokenizer-init",
                                        "--served-model-name", "tiny", log_path=str(tmp_path / "server.log"))
    try:
        bare = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        answer = bare.completions.create(model="tiny", prompt=prompt, **greedy).choices[0]
        assert answer.text == "" and answer.model_extra["token_ids"] == expected.model_extra["token_ids"]
        assert answer.model_extra["prompt_token_ids"] == prompt and len(answer.model_extra["token_ids"]) == 5
        streamed = bare.completions.create(model="tiny", prompt=prompt, stream=True, **greedy)
        assert [t for c in streamed for t in c.choices[0].model_extra["token_ids"]] == answer.model_extra["token_ids"]
        for call, field in ((lambda: bare.completions.create(model="tiny", prompt="text", max_tokens=2), "prompt"),
                            (lambda: bare.completions.create(model="tiny", prompt=prompt, max_tokens=2, echo=True),
                             "echo"),
                            (lambda: bare.chat.completions.create(model="tiny", messages=HELLO), "messages")):
            with pytest.raises(openai.BadRequestError) as error:
                call()
            assert error.value.body["param"] == field, error.value.body
    finally:
        stop_server_process(process)
    assert "Traceback" not in (tmp_path / "server.log").read_text()


BEAMS = {"model": "tiny", "prompt": [256, 10, 20, 30, 40, 50], "n": 3, "max_tokens": 7}


def test_beam_search_answers_the_reference_beams(client, tiny_checkpoint):
    """use_beam_search (vLLM's field): n choices, the beams of the NumPy reference's beam search, best first; a
    stream sends each beam whole when the search ends (its beams reorder until then), as vLLM's server does."""
    from reference import LlamaModel, beam_search

    model, prompt = LlamaModel(tiny_checkpoint.config, tiny_checkpoint.weights), BEAMS["prompt"]
    expected = [tokens[len(prompt):] for tokens, _ in
                beam_search(model, prompt, 3, 7, tiny_checkpoint.config.eos_token_ids, length_penalty=0.5)]
    fields = {"use_beam_search": True, "length_penalty": 0.5, "return_token_ids": True, "top_p": 1.0}
    answer = client.completions.create(**BEAMS, extra_body=fields)
    assert [c.model_extra["token_ids"] for c in answer.choices] == expected
    assert [c.text for c in answer.choices] == [tiny_checkpoint.tokenizer.decode(t, skip_special_tokens=True)
                                                for t in expected]
    assert answer.usage.completion_tokens == sum(map(len, expected))
    longer = {**BEAMS, "max_tokens": 40}  # steps enough for the stream to see the search before its end
    answer = client.completions.create(**longer, extra_body=fields)
    events = [c.choices[0] for c in client.completions.create(**longer, stream=True, extra_body=fields)]
    assert sorted((c.index, c.text, c.finish_reason) for c in events) == [
        (c.index, c.text, c.finish_reason) for c in answer.choices]
    bystander = {"model": "tiny", "prompt": "x", "max_tokens": 20, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = client.completions.create(**bystander).choices[0].text
    with ThreadPoolExecutor(1) as pool:  # the widest search this server holds (n = max_num_seqs) beside it
        beside = pool.submit(client.completions.create, **bystander)
        assert len(client.completions.create(**{**longer, "n": 4}, extra_body=fields).choices) == 4
        assert beside.result().choices[0].text == alone
    chat = client.chat.completions.create(model="tiny", messages=HELLO, n=2, max_tokens=4,
                                          extra_body={"use_beam_search": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens <= 8
    assert chat.choices[0].message.content != chat.choices[1].message.content


@pytest.mark.parametrize("fields, param", [
    ({"top_p": 0.5}, "top_p"), ({"logprobs": 2}, "logprobs"), ({"stop": ["a"]}, "stop"), ({"seed": 1}, "seed"),
    ({"n": 11}, "n"), ({"n": 5}, "n"), ({"temperature": 0.7}, "temperature"),
    ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty")])
def test_beam_search_refuses_what_it_would_not_honour(server, fields, param):
    """Fields beam search does not use are a 400 naming them (vLLM drops them silently), as is a
    length_penalty without beam search; n is capped by the top log-probabilities a step reads (2 per beam)
    and by max_num_seqs (4 here)."""
    response = httpx.post(f"{server}/v1/completions", json={**BEAMS, "use_beam_search": True, **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_server_started_for_text_refuses_embeddings_naming_the_task(client):
    with pytest.raises(openai.BadRequestError, match="--task embed") as error:
        client.embeddings.create(model="tiny", input="Hello")
    assert error.value.body["param"] == "task"


ROLE_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
# ROLE_TEMPLATE reading OpenAI's content parts: --chat-template-content-format auto gives it lists.
PARTS_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
                  "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def test_chat_template_flag_serves_a_model_without_one(templateless_checkpoint_dir, tiny_checkpoint, tmp_path):
    """vLLM's --chat-template (a file here) renders the chat requests of a checkpoint that has no template; with
    continue_final_message the model goes on writing the last message, which add_generation_prompt excludes
    (a 400 naming the field). /tokenize renders with the same template. The template loops over each message's
    content parts, so it is given lists: a string content as one part, text parts as they came."""
    (tmp_path / "template.jinja").write_text(PARTS_TEMPLATE)
    process, url = start_server_process(templateless_checkpoint_dir, *cli_flags(**ENGINE), "--served-model-name",
                                        "tiny", "--chat-template", str(tmp_path / "template.jinja"),
                                        log_path=str(tmp_path / "server.log"))
    encode = tiny_checkpoint.tokenizer.encode
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        answer = forced_chat(client, "hello there")
        assert answer.choices[0].message.content == "hello there"
        assert answer.usage.prompt_tokens == len(encode("user: Hello\nassistant:"))
        split = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
        assert httpx.post(f"{url}/tokenize", json={"messages": split}).json()["tokens"] == encode(
            "user: Hello\nassistant:")
        started = [*HELLO, {"role": "assistant", "content": "Hi th"}]
        continued = {"messages": started, "add_generation_prompt": False, "continue_final_message": True}
        assert httpx.post(f"{url}/tokenize", json=continued).json()["tokens"] == encode("user: Hello\nassistant: Hi th")
        answer = client.chat.completions.create(model="tiny", messages=started, max_tokens=3, extra_body={
            "add_generation_prompt": False, "continue_final_message": True, "structured_outputs": {"regex": "ere"}})
        assert answer.choices[0].message.content == "ere"
        with pytest.raises(openai.BadRequestError, match="cannot both be true") as error:
            client.chat.completions.create(model="tiny", messages=started, extra_body={"continue_final_message": True})
        assert error.value.body["param"] == "continue_final_message"
    finally:
        stop_server_process(process)
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def test_chat_template_flag_takes_a_file_or_the_template_and_checks_it_before_the_start(tmp_path):
    """vLLM's rule: a value that names no readable file is the template itself if it holds a brace or a newline
    (its backslash escapes read as in a Python string); otherwise it is a missing file. A syntax error is refused
    when the server starts, not at each chat request."""
    (tmp_path / "t.jinja").write_text(ROLE_TEMPLATE)
    assert load_chat_template(str(tmp_path / "t.jinja")) == ROLE_TEMPLATE
    assert load_chat_template("{{ messages[0]['content'] }}\\n« » 你") == "{{ messages[0]['content'] }}\n« » 你"
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file's path, but it cannot be read"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")
    run = subprocess.run([sys.executable, "-m", "jax_engine", "serve", "--chat-template", "{% if %}"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "--chat-template is not a valid Jinja template" in run.stderr


def test_without_allowed_origins_no_web_page_may_call(server):
    """No --allowed-origins: no CORS answer for any origin (vLLM's default allows any, but then every site the
    user visits could drive a server on their machine)."""
    headers = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    preflight = httpx.options(f"{server}/v1/completions", headers=headers)
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers
    answer = httpx.get(f"{server}/v1/models", headers={"Origin": "https://app.example"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


STATS_LINE = re.compile(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
                        r"Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: [\d.]+%, "
                        r"Prefix cache hit rate: [\d.]+%")


def test_the_log_says_what_was_served_while_there_is_work(client, server_log):
    """vLLM's periodic stats line ($VLLM_LOG_STATS_INTERVAL: 0.5 s for this server): the interval's prompt and
    generation throughput, requests running and waiting, KV-cache usage and prefix-cache hits; at INFO only while
    there is work, so an idle server's log stays quiet."""
    def lines() -> list[tuple[float, ...]]:
        return [tuple(map(float, m.groups())) for m in STATS_LINE.finditer(server_log.read_text())]

    before = len(lines())
    forced_chat(client, "a" * 30)
    wait_for(lambda: any(generated > 0 for _, generated, *_ in lines()[before:]), 10, "a line of the chat's tokens")
    time.sleep(1.5)  # three idle intervals
    assert all(any(figures) for figures in lines()), "an idle interval was logged at INFO"
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in server_log.read_text()  # uvicorn's line per request


def test_a_model_served_under_several_names_answers_to_each(client):
    """--served-model-name with several names (vLLM's): /v1/models lists each, a request may name any, and the
    answer names the first; any other name is a 400 listing them."""
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-2"]
    answer = client.completions.create(model="tiny-2", prompt="x", max_tokens=2)
    assert answer.model == "tiny" and answer.choices[0].finish_reason is not None
    with pytest.raises(openai.BadRequestError, match=r"this server serves \['tiny', 'tiny-2'\]") as error:
        client.completions.create(model="tiny-3", prompt="x", max_tokens=2)
    assert error.value.body["param"] == "model"


def test_request_ids_name_the_answer_and_come_back_in_a_header(server, client):
    """vLLM's request_id field, and its X-Request-Id header (which wins), name the answer; with
    --enable-request-id-headers every answer carries the header, the request's or a new one. One id sent twice
    at once runs twice (the engine's own ids differ); an id that is not 1-256 visible characters is a 400."""
    answer = client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"request_id": "job-7"})
    assert answer.id == "cmpl-job-7"
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=HELLO, max_tokens=2,
                                                           extra_headers={"X-Request-Id": "trace-1"},
                                                           extra_body={"request_id": "job-7"})
    assert raw.parse().id == "chatcmpl-trace-1" and raw.headers["x-request-id"] == "trace-1"
    assert re.fullmatch("[0-9a-f]{32}", httpx.get(f"{server}/health").headers["x-request-id"])
    twice = {"model": "tiny", "prompt": "x", "max_tokens": 60, "extra_body": {"request_id": "same", "ignore_eos": True}}
    with ThreadPoolExecutor(2) as pool:
        assert [a.id for a in pool.map(lambda _: client.completions.create(**twice), range(2))] == ["cmpl-same"] * 2
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    for bad, param in (({"X-Request-Id": "a" * 257}, {}), ({}, {"request_id": "two words"})):
        reply = httpx.post(f"{server}/v1/completions", json={**body, **param}, headers=bad)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == (
            "X-Request-Id" if bad else "request_id"), reply.text


def test_a_priority_needs_the_priority_scheduling_policy(client):
    """vLLM's `priority` field: 0 (its default) is taken; any other value is a 400 naming it unless the server runs
    --scheduling-policy priority (tests/test_scheduling_policy.py), and a priority that is not an int is too."""
    assert forced_chat(client, "ok", priority=0).choices[0].message.content == "ok"
    for priority, message in ((3, "priority must be 0 unless scheduling_policy is 'priority'"), (1.5, "priority"),
                              (2**63, "priority")):
        with pytest.raises(openai.BadRequestError, match=message) as error:
            client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body={"priority": priority})
        assert error.value.body["param"] == "priority"
