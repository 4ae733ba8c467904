"""The OpenAI-compatible server as users meet it: `jax-engine serve` in its own process on 127.0.0.1, driven
by the official `openai` client (and raw HTTP where the client would hide what is sent)."""

import asyncio
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from jax_engine.engine_core.launch import CORE_MODULE
from jax_engine.server.server_config import LOG_STATS_INTERVAL_ENV
from tests.server_helpers import (child_processes, cli_flags, maps_jaxlib, metric, start_server_process,
                                  stop_server_process, wait_for)

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
WEB_APP = "https://app.example"  # the one origin whose pages may call the module's server (CORS)
# httpx waits 5 s by default; this server compiles on first use (enforce_eager), and a new step shape compiled on
# CI's 2 busy cores took longer than that (a ReadTimeout of the metrics test's 256-token step).
GENERATION_TIMEOUT = 120
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("server") / "server.log"


@pytest.fixture(scope="module")
def server_process(server_log):
    log = server_log
    process, url = start_server_process(
        *cli_flags(api_key=API_KEY, max_model_len=256, num_gpu_blocks_override=256, max_num_seqs=8,
                   max_num_batched_tokens=256, max_waiting_requests=64, enforce_eager=True,
                   allowed_origins=json.dumps([WEB_APP]), disable_log_stats=True, disable_uvicorn_access_log=True),
        log_path=str(log), env={LOG_STATS_INTERVAL_ENV: "0.5"})
    yield process, url
    stop_server_process(process)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


@pytest.fixture(scope="module")
def server(server_process):
    return server_process[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def _all_blocks_free(url: str) -> bool:
    return (metric(url, "vllm:num_free_kv_blocks", AUTH) == metric(url, "vllm:num_kv_blocks", AUTH)
            and metric(url, "vllm:num_requests_running", AUTH) == 0)


def test_models_lists_the_served_model(client, server):
    [card] = client.models.list().data
    assert card.id == MODEL and card.max_model_len == 256
    # vLLM's run-time LoRA routes exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING set (tests/test_server_lora.py)
    load = {"lora_name": "a", "lora_path": "/tmp"}
    assert httpx.post(f"{server}/v1/load_lora_adapter", json=load, headers=AUTH).status_code == 404


def test_the_model_runs_in_the_core_process_alone(server_process, client):
    """The server's process (HTTP, tokenizer, detokenizer) never imports JAX (~1.4 s of CPU at start-up, beside
    the core loading the model); its engine core process runs the model."""
    process, _ = server_process
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    [core] = [pid for pid, command in child_processes(process.pid) if CORE_MODULE in command]
    assert (maps_jaxlib(process.pid), maps_jaxlib(core)) == (False, True)


def test_streamed_text_equals_non_streamed_text(client):
    for stop in (None, ["answer"]):
        full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop)
        chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                           stream=True)
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert streamed == full.choices[0].text and streamed
    assert "Paris" in full.choices[0].text and "answer" not in full.choices[0].text  # cut at the stop string
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    assert "Paris" in chat.choices[0].message.content


def test_usage_counts_tokens(client, server):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    prompt_tokens = httpx.post(f"{server}/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()["count"]
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == 7 and out.usage.total_tokens == prompt_tokens + 7
    assert out.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    *_, last = list(stream)
    assert last.choices == [] and last.usage.completion_tokens == 5 and last.usage.prompt_tokens > 5


def test_parallel_samples_seed_and_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=7,
                                    logprobs=3)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=7,
                                      logprobs=3)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    for choice in out.choices:
        lp = choice.logprobs
        assert "".join(lp.tokens) == choice.text
        assert all(len(top) <= 4 and max(top.values()) <= 0 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2)
    for position in chat.choices[0].logprobs.content:
        assert len(position.top_logprobs) == 2
        assert position.logprob == pytest.approx(position.top_logprobs[0].logprob)  # greedy picks rank 1


BAD_COMPLETIONS = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": PROMPT, "max_tokens": 300}, "max_tokens"),
    ({"prompt": "word " * 300}, "prompt"),
    ({"prompt": PROMPT, "n": 17}, "n"),
    ({"prompt": PROMPT, "temperature": float("nan")}, "temperature"),
    ({"prompt": PROMPT, "temperature": float("inf")}, "temperature"),
    ({"prompt": PROMPT, "temperature": -0.5}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "top_p": 1.01}, "top_p"),
    ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ({"prompt": PROMPT, "model": "gpt-4"}, "model"),
    ({"prompt": [1, 2, 49152]}, "prompt"),
    ({"prompt": [[5, -1]]}, "prompt"),
    ({"prompt": PROMPT, "stop": [""]}, "stop"),
]


def _assert_openai_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert "Traceback" not in error["message"] and ".py" not in error["message"]


def test_every_bad_input_is_a_400_naming_the_field(server):
    for body, param in BAD_COMPLETIONS:
        # json.dumps writes NaN and Infinity, as some clients do; the server must refuse them, not crash
        response = httpx.post(f"{server}/v1/completions", content=json.dumps({"model": MODEL, **body}),
                              headers={**AUTH, "Content-Type": "application/json"})
        _assert_openai_error(response, 400, param)
    for raw in (b"{not json", b"[]", b'"a string"', b"null", b""):
        response = httpx.post(f"{server}/v1/completions", content=raw,
                              headers={**AUTH, "Content-Type": "application/json"})
        _assert_openai_error(response, 400, None)
    chat_cases = [({"messages": []}, "messages"), ({"messages": CHAT, "top_logprobs": 21, "logprobs": True},
                                                   "top_logprobs"),
                  ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
                  ({"messages": [{"role": "user", "content": "word " * 300}]}, "messages")]
    for body, param in chat_cases:
        _assert_openai_error(httpx.post(f"{server}/v1/chat/completions", json=body, headers=AUTH), 400, param)
    _assert_openai_error(httpx.post(f"{server}/detokenize", json={"tokens": [10**9]}, headers=AUTH), 400, "tokens")
    assert _all_blocks_free(server)


def test_the_openai_client_sees_bad_requests(client):
    with pytest.raises(openai.BadRequestError, match="n must be <= 16"):
        client.completions.create(model=MODEL, prompt=PROMPT, n=17)
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=CHAT)


def test_api_key_is_required_everywhere_but_health(server):
    assert httpx.get(f"{server}/health").status_code == 200
    for path in ("/v1/models", "/v1/models/", "/metrics", "//v1/models", "/health/", "/HEALTH", "/openapi.json"):
        assert httpx.get(f"{server}{path}").status_code == 401, path
        assert httpx.get(f"{server}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
    spoofed = {"Host": "localhost", "X-Forwarded-For": "127.0.0.1", "Authorization": f"Bearer {API_KEY}x"}
    response = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPT}, headers=spoofed)
    _assert_openai_error(response, 401, None)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server}/v1/models", headers=AUTH).status_code == 200


def test_a_client_that_disconnects_has_its_request_aborted(server):
    body = {"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "stream": True}

    def tokens_generated_by(hang_up) -> float:
        before = metric(server, "vllm:generation_tokens_total", AUTH)
        hang_up()
        wait_for(lambda: _all_blocks_free(server), 30, "the abandoned request's blocks")
        return metric(server, "vllm:generation_tokens_total", AUTH) - before

    def mid_stream():
        with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    return  # one token arrived; now hang up

    def while_waiting_for_the_answer():
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server}/v1/completions", json={**body, "stream": False}, headers=AUTH, timeout=0.5)

    # Had it run on, each request would have generated all 240 tokens before freeing its blocks.
    assert tokens_generated_by(mid_stream) < 200
    assert tokens_generated_by(while_waiting_for_the_answer) < 200


def test_fifty_concurrent_requests_all_complete(server):
    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        requests = [client.completions.create(model=MODEL, prompt=f"{i} + {i} =", max_tokens=3 + i % 6,
                                              temperature=0.8, seed=i, extra_body={"ignore_eos": True})
                    for i in range(50)]
        return await asyncio.gather(*requests)

    outputs = asyncio.run(run())
    assert [o.usage.completion_tokens for o in outputs] == [3 + i % 6 for i in range(50)]
    assert all(o.choices[0].finish_reason == "length" for o in outputs)
    assert _all_blocks_free(server)


def test_tokenize_detokenize_and_the_demo_endpoint(server):
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    assert httpx.post(f"{server}/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH).json() == {
        "prompt": PROMPT}
    chat_tokens = httpx.post(f"{server}/tokenize", json={"messages": CHAT}, headers=AUTH).json()
    assert chat_tokens["count"] > tokens["count"]
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    text = httpx.post(f"{server}/generate", json=body, headers=AUTH, timeout=GENERATION_TIMEOUT).json()["text"]
    with httpx.stream("POST", f"{server}/generate", json={**body, "stream": True}, headers=AUTH,
                      timeout=GENERATION_TIMEOUT) as response:
        pieces = [json.loads(p) for p in response.read().split(b"\0") if p]
    assert pieces[-1]["text"] == text and text[0].startswith(PROMPT) and len(pieces) == 6
    _assert_openai_error(httpx.post(f"{server}/generate", json={**body, "temperature": -1}, headers=AUTH), 400,
                         "temperature")
    _assert_openai_error(httpx.post(f"{server}/generate", json={**body, "bogus": 1}, headers=AUTH), 400, "bogus")


def test_metrics_count_what_was_served(server):
    before = {name: metric(server, name, AUTH) for name in
              ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
               "vllm:prefix_cache_queries_total")}
    # Two prompts of ~200 tokens in one request: the second's prompt is computed in two steps (256-token budget),
    # the first of which reports it with no token yet.
    prompts = [f"{PROMPT} {' '.join([word] * 200)}" for word in ("red", "blue")]
    body = {"prompt": prompts, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    usage = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=GENERATION_TIMEOUT).json()["usage"]
    assert usage["prompt_tokens"] > 400
    assert metric(server, "vllm:prompt_tokens_total", AUTH) - before["vllm:prompt_tokens_total"] == usage[
        "prompt_tokens"]
    assert metric(server, "vllm:generation_tokens_total", AUTH) - before["vllm:generation_tokens_total"] == 10
    assert metric(server, "vllm:time_to_first_token_seconds_count", AUTH) == before[
        "vllm:time_to_first_token_seconds_count"] + 2
    assert metric(server, "vllm:prefix_cache_queries_total", AUTH) > before["vllm:prefix_cache_queries_total"]
    assert metric(server, "vllm:inter_token_latency_seconds_count", AUTH) >= 4
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_hits_total"):
        metric(server, name, AUTH)  # present
    # This server compiles on first use (enforce_eager): each program it compiled after start-up is counted.
    assert metric(server, "jax_engine:compilations_total", AUTH) >= 3  # a step, the logits, a sampler
    assert metric(server, "jax_engine:compile_seconds_total", AUTH) > 0
    assert metric(server, "jax_engine:num_programs", AUTH) >= 3
    assert metric(server, "jax_engine:program_evictions_total", AUTH) == 0


def test_bench_serve_measures_every_request(server, capsys):
    from jax_engine.bench.workloads import request_lengths
    from jax_engine.cli import main

    main(["bench", "serve", "--base-url", server, "--api-key", API_KEY, "--num-prompts", "12", "--request-rate", "20",
          "--length-mode", "alpaca-like", "--seed", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    inputs, outputs, _ = request_lengths(12, "alpaca-like", 256, seed=1)
    assert report["successful_requests"] == 12 and report["failed_requests"] == 0
    assert report["total_output_tokens"] == outputs.sum() and report["total_input_tokens"] == inputs.sum()
    assert 0 < report["median_ttft_ms"] <= report["p99_ttft_ms"] < report["p99_e2el_ms"]
    assert 0 < report["mean_itl_ms"] and 0 < report["mean_tpot_ms"]
    main(["bench", "serve", "--base-url", server, "--api-key", API_KEY, "--num-prompts", "4", "--max-concurrency",
          "2", "--length-mode", "fixed", "--input-len", "8", "--output-len", "4"])
    printed = capsys.readouterr().out
    assert "Successful requests:" in printed and "Mean TTFT (ms):" in printed and "Failed requests:  " in printed


def test_bench_serve_names_every_filter_in_every_request(server, capsys):
    """Each request carries top_k, top_p and min_p even when off, so a peer's own defaults (llama-server's top_k 40,
    top_p 0.95, min_p 0.05) cannot give it less work than ours; the filters are checked before anything is sent."""
    import argparse

    from jax_engine.bench.serve_workload import client_for, make_workload
    from jax_engine.cli import main

    ns = argparse.Namespace(num_prompts=3, length_mode="fixed", input_len=4, output_len=2, seed=0, top_k=0,
                            top_p=1.0, min_p=0.0)

    async def bodies(**filters):
        async with client_for(server, API_KEY) as client:
            return (await make_workload(client, argparse.Namespace(**{**vars(ns), **filters}), 1.0)).bodies

    off, on = asyncio.run(bodies()), asyncio.run(bodies(top_k=40, top_p=0.95, min_p=0.05))
    assert all((b["top_k"], b["top_p"], b["min_p"]) == (0, 1.0, 0.0) for b in off)
    assert all((b["top_k"], b["top_p"], b["min_p"]) == (40, 0.95, 0.05) for b in on)
    main(["bench", "serve", "--base-url", server, "--api-key", API_KEY, "--num-prompts", "4", "--length-mode", "fixed",
          "--input-len", "8", "--output-len", "4", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.05", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["successful_requests"] == 4 and report["failed_requests"] == 0
    assert report["sampling"] == {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    for flag, value, limit in [("--top-p", "0", "in (0, 1]"), ("--top-k", "-1", ">= 0"), ("--min-p", "2", "in [0, 1]")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "serve", "--base-url", "http://127.0.0.1:9", flag, value])
        assert f"{flag} must be {limit}" in str(exit_info.value.code)


def test_pages_of_the_allowed_origin_may_call_from_a_browser(server):
    """--allowed-origins (vLLM's CORS flags): a browser's preflight for the origin is answered without a key (it
    carries none), and the answers to its requests, errors too, say the origin may read them; another origin is
    told nothing (test_server_vllm_fields.py: without the flag, no origin is)."""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = httpx.options(f"{server}/v1/completions", headers={"Origin": WEB_APP, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == WEB_APP
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 2}
    answer = httpx.post(f"{server}/v1/completions", json=body, headers={"Origin": WEB_APP, **AUTH})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == WEB_APP
    refused = httpx.post(f"{server}/v1/completions", json=body, headers={"Origin": WEB_APP})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == WEB_APP
    other = "https://elsewhere.example"
    assert httpx.options(f"{server}/v1/completions", headers={"Origin": other, **preflight}).status_code == 400
    answer = httpx.post(f"{server}/v1/completions", json=body, headers={"Origin": other, **AUTH})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
    run = subprocess.run([sys.executable, "-m", "jax_engine", "serve", "--allowed-origins", "https://app.example"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--allowed-origins: not JSON" in run.stderr


def test_the_log_flags_leave_out_the_stats_line_and_the_line_per_request(client, server_log):
    """--disable-log-stats and --disable-uvicorn-access-log (vLLM's flags): no stats line, however short the
    interval (0.5 s for this server) and whatever was served, and no line per request
    (test_server_vllm_fields.py shows both without the flags)."""
    client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8)
    time.sleep(1.0)
    log = server_log.read_text()
    assert "Avg prompt throughput" not in log and "POST /v1/completions" not in log
