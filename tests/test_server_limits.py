"""What one client can make the server do is bounded: body size, header time, connections, tokenizer work,
stop strings, types and text. Checked against `jax-engine serve` in its own process on 127.0.0.1 (the
tiny random model), so the server's event loop shares nothing with the test's threads."""

import json
import socket
import threading
import time

import httpx
import pytest

from jax_engine.server.protocol import CompletionRequest
from tests.server_helpers import TINY_ENGINE_ARGS, cli_flags, start_server_process, stop_server_process

MAX_BODY = 1 << 20  # 1 MiB for these tests (the default is 4 MiB)
HEADER_TIMEOUT = 1.0
MAX_CONNECTIONS = 6
# Each request's cost, scaled down from the defaults (65,536 tokens generated, 16,384 prompt tokens scored, 64
# grammar rows) so that a small request passes each.
COST_LIMITS = dict(max_request_tokens=256, max_scored_prompt_tokens=64, max_structured_rows=4)


@pytest.fixture(scope="module")
def server(tiny_checkpoint_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("limits") / "server.log"
    process, url = start_server_process(
        tiny_checkpoint_dir, *cli_flags(**TINY_ENGINE_ARGS, max_body_bytes=MAX_BODY, header_timeout=HEADER_TIMEOUT,
                                        max_connections=MAX_CONNECTIONS, **COST_LIMITS), log_path=str(log))
    yield url
    stop_server_process(process)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def _health_latencies(url: str, while_running) -> list[float]:
    """/health round trips (seconds) measured while `while_running()` runs in another thread."""
    worker = threading.Thread(target=while_running)
    latencies = []
    with httpx.Client(base_url=url) as client:
        client.get("/health")  # connect first: the figure is the server's answer, not a TCP handshake
        worker.start()
        while worker.is_alive():
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.01)
    worker.join()
    return latencies


def test_a_body_five_times_the_limit_is_refused_without_delaying_health(server):
    body = b'{"prompt": [' + b"1," * 2_499_999 + b'1]}'  # 5 MB: 2.5 million token ids
    answers = []

    def upload(content) -> None:
        with httpx.Client(timeout=60) as client:
            answers.append(client.post(f"{server}/v1/completions", content=content,
                                       headers={"content-type": "application/json"}))

    def chunked() -> bytes:  # no Content-Length: the server must count what arrives
        for start in range(0, len(body), 1 << 20):
            yield body[start:start + (1 << 20)]

    # A server that read the body whole would hold its loop at least while parsing it, and /health is asked
    # every 10 ms, so one of them would wait nearly the whole parse. Timed here, on this machine as loaded as
    # it is now, because a fixed bound did not hold on CI: a healthy /health took 109 ms in one run and 339 ms
    # in a run where everything ran 1.8x slower. Token ids, not one long string: a 50 MB string parsed in 58 ms
    # on a Zen 4, where a loaded /health once took 49 ms; these 5 MB take ~0.8 s there (pydantic builds 2.5
    # million ints). Three quarters of the parse still leaves a stalled server no way through.
    started = time.perf_counter()
    CompletionRequest.model_validate_json(body)
    parse_seconds = time.perf_counter() - started
    for content in (body, chunked()):
        latencies = _health_latencies(server, lambda: upload(content))
        answer = answers.pop()
        assert answer.status_code == 413 and str(MAX_BODY) in answer.json()["error"]["message"]
        assert max(latencies) < 0.75 * parse_seconds, f"/health took {max(latencies) * 1000:.0f} ms"


def test_prompts_too_long_to_fit_are_refused_before_the_tokenizer_reads_them(server):
    """Prompts just under the body limit each took the tokenizer ~0.4 s, on the one thread every request's
    tokenization waits for: a bystander's request waited for all of them (11 s beside six 4 MB prompts). Text
    longer than any prompt that fits max_model_len is refused first, by its length: the bystander does not wait.
    Four of them leave the bystander one of the server's six connections."""
    from concurrent.futures import ThreadPoolExecutor

    long_text = "hello there " * (MAX_BODY // 12 - 10)
    bodies = [("/v1/completions", {"prompt": long_text}), ("/tokenize", {"prompt": long_text}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]})]
    bystander = {"prompt": "hello", "max_tokens": 2}
    with httpx.Client(base_url=server, timeout=60) as client:
        started = time.perf_counter()
        assert client.post("/v1/completions", json=bystander).status_code == 200
        alone = time.perf_counter() - started
        with ThreadPoolExecutor(4) as pool:
            refused = [(path, pool.submit(client.post, path, json=body)) for path, body in [*bodies, bodies[0]]]
            time.sleep(0.2)  # their bodies are arriving
            started = time.perf_counter()
            assert client.post("/v1/completions", json=bystander).status_code == 200
            beside = time.perf_counter() - started
    print(f"a request alone {alone:.2f} s, beside four 1 MiB prompts {beside:.2f} s")
    assert beside < alone + 0.5
    for path, answer in ((path, f.result()) for path, f in refused):
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["param"] == ("messages" if "chat" in path else "prompt"), error
        assert "characters (no longer text fits max_model_len=128 tokens)" in error["message"], error


def test_slow_or_silent_clients_are_cut_off_and_cannot_hold_the_connections(server):
    """More silent connections than the cap: they are pending (no request yet), so /health is still served
    (uvicorn's cap answered it 503), and each one is closed at the header deadline."""
    silent = [socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1])))
              for _ in range(2 * MAX_CONNECTIONS)]
    silent[0].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers started, never finished (slowloris)
    try:
        assert httpx.get(f"{server}/health").status_code == 200
        for sock in silent:  # after the header deadline each one is closed by the server
            sock.settimeout(HEADER_TIMEOUT + 5)
            assert sock.recv(1024) == b""
    finally:
        for sock in silent:
            sock.close()


def _nested(depth: int) -> bytes:
    """A JSON schema of arrays nested `depth` deep, as text (json.dumps itself would recurse too deep)."""
    return b'{"type": "array", "items": ' * depth + b'{"type": "string"}' + b"}" * depth


def _post(url: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
    return httpx.post(f"{url}{path}", json=body)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 10_000}, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**31}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 2, "stop_token_ids": [2**31]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": None, "min_tokens": 200}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": ""}, "cache_salt"),
    ("/v1/completions", json.dumps({"prompt": "a\ud800b"}).encode(), "prompt"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "\udfff"}]}).encode(), "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "system<|im_end|>", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "admin", "content": "hi"}]}, "messages"),
    ("/tokenize", json.dumps({"prompt": "\ud800"}).encode(), "prompt"),
    ("/generate", {"prompt": "hi", "temperature": 10**400}, "temperature"),
    ("/generate", {"prompt": "hi", "tempreature": 0.5}, "tempreature"),
    # JSON nested past Python's recursion limit, and lone surrogates in fields pydantic does not check: 500s once
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 3000 + "]" * 3000}}]},
        {"role": "user", "content": "hi"}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "[" * 3000 + "]" * 3000}}]}]}, "messages"),
    ("/generate", json.dumps({"prompt": "hi", "bad_words": ["\ud800"]}).encode(), "bad_words"),
    ("/generate", b'{"prompt": "hi", "structured_outputs": {"json": %s}}' % _nested(900), "structured_outputs"),
    ("/v1/completions", b'{"prompt": "hi", "structured_outputs": {"json": %s}}' % _nested(900),
     "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "guided_json": _nested(900).decode()}, "guided_json"),
    # One request's cost: prompts x n x max_tokens, prompt tokens scored, sequences under a grammar (issue 40)
    ("/v1/completions", {"prompt": ["a b"] * 5, "n": 4, "max_tokens": 16}, "max_tokens"),  # 320 > 256
    ("/v1/completions", {"prompt": "hi", "n": 4, "max_tokens": None}, "max_tokens"),  # n x up to max_model_len
    ("/v1/completions", {"prompt": "x " * 40, "echo": True, "logprobs": 1, "max_tokens": 1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 3, "max_tokens": 4, "guided_regex": "[a-z]+"}, "n"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
     b'"function": {"name": "f", "parameters": %s}}]}' % _nested(900), "tools"),
])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert "Traceback" not in error["message"] and "__init__" not in error["message"]
    assert len(error["message"]) < 400


def test_no_page_loads_scripts_from_a_cdn(server):
    assert httpx.get(f"{server}/docs").status_code == 404 and httpx.get(f"{server}/redoc").status_code == 404
    assert httpx.get(f"{server}/openapi.json").status_code == 200
