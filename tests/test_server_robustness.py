"""The server under load, bad input, a dying engine and SIGTERM, on real HTTP servers on 127.0.0.1.

Most tests serve the tiny random model from a thread of this process, so they can slow its steps down (a
stand-in for a bigger model) or break its device; the SIGTERM test runs `jax-engine serve` as a process.
"""

import contextlib
import json
import re
import signal
import threading
import time

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from jax_engine import EngineArgs, LLMEngine
from jax_engine.async_llm_engine import AsyncLLMEngine
from jax_engine.server.server_config import ServerConfig
from tests.server_helpers import (TINY_ENGINE_ARGS, ThreadedServer, cli_flags, data_lines, events_after, metric,
                                  start_server_process, wait_for)

ARGS = TINY_ENGINE_ARGS
LONG = {"prompt": "hello there", "max_tokens": 100, "ignore_eos": True, "stream": True}


@contextlib.contextmanager
def tiny_server(checkpoint, step_delay: float = 0.0, gate: threading.Event | None = None,
                max_waiting_requests: int = 8, **engine_args):
    """Serve the tiny model; step_delay seconds are added to every step (a slower model), and with a `gate`
    every step first waits (up to a minute) until the gate is open."""
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**{**ARGS, **engine_args}), checkpoint=checkpoint))
    if step_delay or gate is not None:
        execute = engine.engine.runner.execute

        def slow_execute(inputs):
            if gate is not None:
                gate.wait(60)
            time.sleep(step_delay)
            return execute(inputs)

        engine.engine.runner.execute = slow_execute
    with ThreadedServer(engine, ServerConfig("tiny", max_n=4, max_waiting_requests=max_waiting_requests)) as server:
        yield server.url, engine


@pytest.fixture(scope="module")
def shared_tiny_server(tiny_checkpoint):
    with tiny_server(tiny_checkpoint) as server:
        yield server


def test_a_full_queue_answers_503_at_once(tiny_checkpoint):
    # Steps of 0.2 s: the running request would take 20 s. Once a second request waits, the steps stop at a
    # closed gate, so the queue stays full while the test looks however slow the host (a slow CI host once
    # finished the running request before the last look).
    gate = threading.Event()
    gate.set()
    with tiny_server(tiny_checkpoint, 0.2, gate, max_waiting_requests=1, max_num_seqs=1) as (url, _):
        try:
            with httpx.Client(base_url=url, timeout=60) as a, httpx.Client(base_url=url, timeout=60) as b:
                with a.stream("POST", "/v1/completions", json=LONG) as running:
                    # Held: a dropped line iterator closes the connection, and the server then aborts the request
                    # (which let the waiting one run and the chat request in, on a slow CI host).
                    running_lines = data_lines(running)
                    next(running_lines)  # the first request is running
                    with b.stream("POST", "/v1/completions", json=LONG):
                        wait_for(lambda: metric(url, "vllm:num_requests_waiting") == 1, 10, "a waiting request")
                        gate.clear()
                        for path, body in (("/v1/completions", {**LONG, "stream": False}),
                                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                            started = time.monotonic()
                            refused = httpx.post(f"{url}{path}", json=body, timeout=60)
                            elapsed = time.monotonic() - started
                            assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
                            assert refused.headers["retry-after"] == "1"
                            print(f"503 after {elapsed * 1000:.0f} ms")
                            assert elapsed < 0.5
        finally:
            gate.set()  # the abandoned requests may end
        wait_for(lambda: metric(url, "vllm:num_free_kv_blocks") == ARGS["num_gpu_blocks_override"], 10,
                 "the abandoned requests' blocks")


def test_a_dead_engine_fails_in_flight_requests_then_the_server_shuts_down(tiny_checkpoint):
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**ARGS), checkpoint=tiny_checkpoint))
    with ThreadedServer(engine, ServerConfig("tiny")) as server:
        url, release, shut_down = server.url, threading.Event(), engine.on_dead
        engine.on_dead = lambda: threading.Thread(target=lambda: (release.wait(30), shut_down())).start()
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60) as response:
            events = data_lines(response)
            next(events)

            def broken_device(inputs):
                raise RuntimeError("simulated device failure")

            engine.engine.runner.execute = broken_device
            rest = list(events)
        error = json.loads(rest[-2])["error"]
        assert rest[-1] == "[DONE]" and error["type"] == "service_unavailable_error"
        assert "simulated" not in error["message"]  # the cause is in the server log, not sent to clients
        health = httpx.get(f"{url}/health")  # while the server drains
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
        assert refused.status_code == 503 and "simulated" not in refused.text
        assert health.headers["retry-after"] == refused.headers["retry-after"] == "1"  # every 503 says when
        release.set()
        server.thread.join(timeout=30)
        assert not server.thread.is_alive()  # it shut itself down (jax-engine serve then exits 1)


FAULTY_SERVE = """
import pathlib, sys
from jax_engine.runner.model_runner import ModelRunner

trigger, execute = pathlib.Path(sys.argv[1]), ModelRunner.execute

def execute_until_triggered(self, inputs):
    if trigger.exists():
        raise RuntimeError("injected device fault")
    return execute(self, inputs)

ModelRunner.execute = execute_until_triggered
from jax_engine.cli import main
main(["serve", *sys.argv[2:]])
"""


def test_jax_engine_serve_exits_non_zero_when_the_engine_dies(tiny_checkpoint_dir, tmp_path):
    """So that a supervisor restarts it, as vLLM's server does."""
    trigger = tmp_path / "fault"
    # The fault is patched into this server process's runner: the engine runs here (test_engine_core.py kills a
    # separate engine core).
    process, url = start_server_process(tiny_checkpoint_dir, *cli_flags(**ARGS, engine_core_process=False),
                                        log_path=str(tmp_path / "log"), command=("-c", FAULTY_SERVE, str(trigger)))
    try:
        rest = events_after(url, LONG, trigger.touch)
        assert json.loads(rest[-2])["error"]["code"] == "engine_dead"
        assert process.wait(timeout=60) == 1
    finally:
        process.kill()
    log = (tmp_path / "log").read_text()
    assert "injected device fault" in log and "shutting the server down" in log


def test_a_request_failing_inside_the_engine_fails_alone(shared_tiny_server):
    """A fault in one request's host work gives its client a 500 (an SSE error when streaming) with no
    internals, while the engine and the other requests go on."""
    url, engine = shared_tiny_server
    poison = [250, 251, 252]
    processor = engine.engine.output_processor
    process_token = processor.process_token

    def faulty(seq, sampled, *rest):
        if seq.prompt_token_ids == poison:
            raise RuntimeError("injected fault")
        return process_token(seq, sampled, *rest)

    processor.process_token = faulty
    try:
        body = {"prompt": "abc", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        alone = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as healthy:
            failed = httpx.post(f"{url}/v1/completions", json={**body, "prompt": poison})
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "prompt": poison, "stream": True}) as s:
                streamed_error = json.loads(list(data_lines(s))[-2])["error"]
            text = "".join(json.loads(e)["choices"][0]["text"] for e in data_lines(healthy) if e != "[DONE]")
    finally:
        processor.process_token = process_token
    assert text == alone
    for error in (failed.json()["error"], streamed_error):
        assert error["code"] == "request_failed" and "injected" not in error["message"]
    assert failed.status_code == 500
    assert httpx.get(f"{url}/health").status_code == 200
    wait_for(lambda: metric(url, "vllm:num_free_kv_blocks") == ARGS["num_gpu_blocks_override"], 10, "free blocks")


def test_an_unexpected_error_gives_an_error_id_not_internals(shared_tiny_server, caplog):
    url, engine = shared_tiny_server
    tokenizer = engine.engine.tokenizer
    decode = tokenizer.decode

    def broken_decode(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    tokenizer.decode = broken_decode
    try:
        response = httpx.post(f"{url}/detokenize", json={"tokens": [1, 2]})
    finally:
        tokenizer.decode = decode
    message = response.json()["error"]["message"]
    assert response.status_code == 500 and "secret" not in message
    error_id = re.search(r"error id (err-[0-9a-f]+)", message).group(1)
    assert any(error_id in r.getMessage() and "secret internal detail" in str(r.exc_info) for r in caplog.records)


def test_more_prompts_than_the_queue_holds_is_a_400(shared_tiny_server):
    url, _ = shared_tiny_server
    response = httpx.post(f"{url}/v1/completions", json={"prompt": ["a"] * 9, "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert httpx.post(f"{url}/v1/completions", json={"prompt": ["a"] * 8, "max_tokens": 2}).status_code == 200


def test_failing_requests_do_not_affect_others(shared_tiny_server):
    url, _ = shared_tiny_server
    body = {"prompt": "abc", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        events, pieces = data_lines(response), []
        for i, event in enumerate(events):
            if event == "[DONE]":
                break
            pieces.append(json.loads(event)["choices"][0]["text"])
            if i < 10:  # meanwhile: bad requests, and a request whose client leaves at once
                assert httpx.post(f"{url}/v1/completions", json={**body, "top_p": 2}).status_code == 400
                assert httpx.post(f"{url}/v1/completions", json={"prompt": [1, 300]}).status_code == 400
                with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as leaving:
                    next(data_lines(leaving))
    assert "".join(pieces) == alone


def test_no_generated_request_gets_a_server_error(shared_tiny_server):
    """schemathesis writes valid and invalid requests for every operation in /openapi.json: none may get a 5xx."""
    url, _ = shared_tiny_server
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} == {
        "GET /health", "GET /version", "GET /v1/models", "GET /metrics", "POST /v1/completions",
        "POST /v1/chat/completions", "POST /v1/embeddings", "POST /tokenize", "POST /detokenize", "POST /generate"}
    for operation in operations:
        has_body = operation.method.upper() == "POST"  # GETs take nothing that could be made invalid
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,):
            @given(case=operation.as_strategy(mode))
            @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
            def call(case):
                case.call_and_validate(base_url=url, checks=[not_a_server_error], timeout=60)

            call()


def test_sigterm_lets_in_flight_requests_finish(tmp_path):
    process, url = start_server_process(*cli_flags(max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=2,
                                                  enforce_eager=True),
                                        log_path=str(tmp_path / "server.log"))
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        rest = events_after(url, body, lambda: process.send_signal(signal.SIGTERM))
        # Every token, then the end (counted by usage: a stream whose reader is behind sends the newest text only).
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["usage"]["completion_tokens"] == 120
        assert process.wait(timeout=60) == 0  # a clean drain (uvicorn would end the process by the signal again)
    finally:
        process.kill()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log
    drained, stopped = log.index("Waiting for connections to close"), log.index("Application shutdown complete")
    assert drained < stopped and "Finished server process" in log[stopped:]


def test_prefix_cache_isolation_per_api_key(tiny_checkpoint):
    """With --prefix-cache-isolation api-key, a tenant cannot hit (or time) another tenant's cached prompt."""
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**ARGS), checkpoint=tiny_checkpoint))
    config = ServerConfig("tiny", api_keys=("key-a", "key-b"), prefix_cache_isolation="api-key")
    body = {"prompt": "a shared system prompt of several blocks", "max_tokens": 2}
    with ThreadedServer(engine, config) as server:
        def hits_after(key: str, salt: str | None = None) -> float:
            headers = {"Authorization": f"Bearer {key}"}
            response = httpx.post(f"{server.url}/v1/completions", json={**body, "cache_salt": salt}, headers=headers)
            assert response.status_code == 200, response.text
            return metric(server.url, "vllm:prefix_cache_hits_total", headers)

        cold = hits_after("key-a")
        assert hits_after("key-b") == cold  # another key: no hit
        assert hits_after("key-b", "x") == cold  # nor with a salt of its own
        assert hits_after("key-b", "x") > cold  # the same key and salt hit
        warm = hits_after("key-a")
        assert warm > cold  # the first key hits its own blocks
        assert hits_after("key-a", "x") == warm  # key b's salt "x" is not key a's salt "x"


def test_one_api_key_cannot_fill_the_queue_or_hold_others_back(tiny_checkpoint):
    """Issue 40: requests were served first come, first served, so one key's burst filled the waiting queue
    and another key's 5-token request waited for all of it. Now a key's own waiting requests are capped (503 +
    Retry-After for that key alone) and requests enter the engine by key turns: the other key's request, sent
    after the burst, finishes before the burst's queued requests."""
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**ARGS), checkpoint=tiny_checkpoint))  # 4 sequences at once
    execute = engine.engine.runner.execute
    engine.engine.runner.execute = lambda inputs: time.sleep(0.02) or execute(inputs)  # a request lasts > 2 s
    config = ServerConfig("tiny", api_keys=("key-a", "key-b"), max_waiting_per_key=3)
    finished: dict[str, float] = {}

    def send(key: str, name: str, max_tokens: int) -> int:
        body = {"prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                              timeout=120)
        finished[name] = time.monotonic()
        if response.status_code == 503:
            assert "of this API key" in response.json()["error"]["message"] and response.headers["Retry-After"]
        return response.status_code

    with ThreadedServer(engine, config) as server:
        burst = [threading.Thread(target=lambda i=i: statuses.append(send("key-a", f"a{i}", 100))) for i in range(8)]
        statuses: list[int] = []
        running = engine.engine.scheduler.running
        for i, thread in enumerate(burst):  # 4 enter the engine, 3 wait for their turn, the 8th is refused
            thread.start()
            if i < 4:  # on a loaded host 0.1 s was not always enough to start running: more waited, more were refused
                wait_for(lambda: len(running) == i + 1, 30, f"request a{i} to run")
            time.sleep(0.1)
        wait_for(lambda: 503 in statuses, 30, "the request past key a's own queue to be refused")
        assert send("key-b", "b", 5) == 200
        for thread in burst:
            thread.join()
    assert sorted(statuses) == [200] * 7 + [503]
    served = sorted(finished, key=finished.get)[1:]  # the refused request answered first
    print("finishing order of the served requests:", served)
    assert served.index("b") <= 4  # after the 4 of the burst it found running, before the 3 it found waiting
