"""The server under load, bad input, a dying engine and SIGTERM, on real HTTP servers on 127.0.0.1.

Most tests serve the tiny random model from a thread of this process, so they can slow its steps down (a
stand-in for a bigger model) or break its device; the SIGTERM test runs `jax-engine serve` as a process.
"""

import contextlib
import json
import signal
import time

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from jax_engine import EngineArgs, LLMEngine
from jax_engine.async_llm_engine import AsyncLLMEngine
from jax_engine.server.app import build_app
from jax_engine.server.state import ServerConfig
from tests.server_helpers import ThreadedServer, metric, start_server_process, wait_for

ARGS = dict(num_gpu_blocks_override=64, block_size=8, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
LONG = {"prompt": "hello there", "max_tokens": 100, "ignore_eos": True, "stream": True}


@contextlib.contextmanager
def tiny_server(checkpoint, step_delay: float = 0.0, max_waiting_requests: int = 8, **engine_args):
    """Serve the tiny model; step_delay seconds are added to every step (a slower model)."""
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**{**ARGS, **engine_args}), checkpoint=checkpoint))
    if step_delay:
        execute = engine.engine.runner.execute

        def slow_execute(inputs):
            time.sleep(step_delay)
            return execute(inputs)

        engine.engine.runner.execute = slow_execute
    app = build_app(engine, ServerConfig("tiny", max_n=4, max_waiting_requests=max_waiting_requests))
    with ThreadedServer(app) as server:
        yield server.url, engine


def _data_lines(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


@pytest.fixture(scope="module")
def shared_tiny_server(tiny_checkpoint):
    with tiny_server(tiny_checkpoint) as server:
        yield server


def test_a_full_queue_answers_503_at_once(tiny_checkpoint):
    # Steps of 0.2 s: the running request would take 20 s, so the queue stays full while the test looks.
    with tiny_server(tiny_checkpoint, step_delay=0.2, max_waiting_requests=1, max_num_seqs=1) as (url, _):
        with httpx.Client(base_url=url, timeout=60) as a, httpx.Client(base_url=url, timeout=60) as b:
            with a.stream("POST", "/v1/completions", json=LONG) as running:
                next(_data_lines(running))  # the first request is running
                with b.stream("POST", "/v1/completions", json=LONG):
                    wait_for(lambda: metric(url, "vllm:num_requests_waiting") == 1, 10, "a waiting request")
                    started = time.monotonic()
                    refused = httpx.post(f"{url}/v1/completions", json={**LONG, "stream": False}, timeout=60)
                    assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
                    assert time.monotonic() - started < 2
        wait_for(lambda: metric(url, "vllm:num_free_kv_blocks") == ARGS["num_gpu_blocks_override"], 10,
                 "the abandoned requests' blocks")


def test_a_dead_engine_fails_in_flight_requests_and_health(tiny_checkpoint):
    with tiny_server(tiny_checkpoint, step_delay=0.02) as (url, engine):
        assert httpx.get(f"{url}/health").status_code == 200
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60) as response:
            events = _data_lines(response)
            next(events)

            def broken_device(inputs):
                raise RuntimeError("simulated device failure")

            engine.engine.runner.execute = broken_device
            rest = list(events)
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["type"] == "service_unavailable_error"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
        assert refused.status_code == 503 and "Traceback" not in refused.text


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
        events, pieces = _data_lines(response), []
        for i, event in enumerate(events):
            if event == "[DONE]":
                break
            pieces.append(json.loads(event)["choices"][0]["text"])
            if i < 10:  # meanwhile: bad requests, and a request whose client leaves at once
                assert httpx.post(f"{url}/v1/completions", json={**body, "top_p": 2}).status_code == 400
                assert httpx.post(f"{url}/v1/completions", json={"prompt": [1, 300]}).status_code == 400
                with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as leaving:
                    next(_data_lines(leaving))
    assert "".join(pieces) == alone


def test_no_generated_request_gets_a_server_error(shared_tiny_server):
    """schemathesis writes valid and invalid requests for every operation in /openapi.json: none may get a 5xx."""
    url, _ = shared_tiny_server
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} == {
        "GET /health", "GET /v1/models", "GET /metrics", "POST /v1/completions", "POST /v1/chat/completions",
        "POST /tokenize", "POST /detokenize", "POST /generate"}
    for operation in operations:
        has_body = operation.method.upper() == "POST"  # GETs take nothing that could be made invalid
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,):
            @given(case=operation.as_strategy(mode))
            @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
            def call(case):
                case.call_and_validate(base_url=url, checks=[not_a_server_error], timeout=60)

            call()


def test_sigterm_lets_in_flight_requests_finish(tmp_path):
    process, url = start_server_process("--max-model-len", "256", "--num-gpu-blocks-override", "64",
                                        "--max-num-seqs", "2", log_path=str(tmp_path / "server.log"))
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            events = _data_lines(response)
            next(events)
            process.send_signal(signal.SIGTERM)
            rest = list(events)
        assert rest[-1] == "[DONE]" and len(rest) - 1 == 119  # every remaining token, then the end
        # uvicorn re-raises the signal once shut down, so the exit status says "ended by SIGTERM" as usual
        assert process.wait(timeout=60) == -signal.SIGTERM
    finally:
        process.kill()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log
    drained, stopped = log.index("Waiting for connections to close"), log.index("Application shutdown complete")
    assert drained < stopped and "Finished server process" in log[stopped:]
