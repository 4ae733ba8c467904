"""What a client can hold of the server's connections, buffers and shutdown: clients without a key, slow bodies,
streams nobody reads, SIGTERM beside them. Checked against `jax-engine serve` in its own process on 127.0.0.1
(tiny random models), so the server's memory and exit status are its own."""

import asyncio
import json
import re
import signal
import socket
import threading
import time

import httpx
import pytest

from jax_engine.server.streams import merge
from tests.server_helpers import (TINY_ENGINE_ARGS, cli_flags, metric, start_server_process, stop_server_process,
                                  wait_for)

KEY = "transport-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONNECTIONS = 4
MAX_PENDING = 4
BODY_TIMEOUT = 1.0
# A model with room for long outputs: a stream of 4,000 tokens takes the tiny model 10-30 s on 2 cores.
LONG_ARGS = {**TINY_ENGINE_ARGS, "num_gpu_blocks_override": 520, "max_model_len": 4096}
LONG_STREAM = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "logprobs": 20, "stream": True}


@pytest.fixture(scope="module")
def keyed_server(tiny_checkpoint_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("transport") / "server.log"
    process, url = start_server_process(
        tiny_checkpoint_dir, "--api-key", KEY,
        *cli_flags(**TINY_ENGINE_ARGS, max_connections=MAX_CONNECTIONS, max_pending_connections=MAX_PENDING,
                   header_timeout=60, body_timeout=BODY_TIMEOUT), log_path=str(log))
    yield url
    stop_server_process(process)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _closed_by_server(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def _reset_by_server(sock: socket.socket) -> bool:
    """Whether the server reset the connection (what a client that does not read gets), after what it sent."""
    sock.settimeout(5)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        return True
    finally:
        sock.close()
    return False


def test_clients_without_a_key_cannot_hold_the_connections(keyed_server):
    """Slowloris connections and a client reconnecting without a key as fast as it can: keyed requests and
    /health are still served (uvicorn's cap would answer them 503), and the oldest idle keyless connections
    are closed to make room."""
    url = keyed_server
    hogs = [socket.create_connection(("127.0.0.1", _port(url))) for _ in range(3 * MAX_PENDING)]
    for hog in hogs:
        hog.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers started, never finished
    stop, refused = threading.Event(), []

    def reconnect_without_a_key() -> None:
        while not stop.is_set():
            answer = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
            refused.append((answer.status_code, answer.headers.get("connection")))

    flood = threading.Thread(target=reconnect_without_a_key)
    flood.start()
    try:
        for _ in range(5):
            assert httpx.get(f"{url}/health").status_code == 200
            answer = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH,
                                timeout=60)
            assert answer.status_code == 200, answer.text
    finally:
        stop.set()
        flood.join()
    assert refused and set(refused) == {(401, "close")}  # answered at once, and the connection closed
    try:
        closed = sum(map(_closed_by_server, hogs))
        assert closed >= 2 * MAX_PENDING, f"{closed} of {len(hogs)} slow connections were closed"
    finally:
        for hog in hogs:
            hog.close()


def test_past_the_cap_a_keyed_connection_gets_a_json_503_with_retry_after(keyed_server):
    url = keyed_server
    clients = [httpx.Client(base_url=url, headers=AUTH) for _ in range(MAX_CONNECTIONS)]
    try:
        for client in clients:  # each holds a keep-alive connection that sent a valid key
            assert client.get("/v1/models").status_code == 200
        refused = httpx.get(f"{url}/v1/models", headers=AUTH)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.headers["connection"] == "close"
        error = refused.json()["error"]
        assert error["code"] == "too_many_connections" and error["type"] == "service_unavailable_error"
        assert httpx.get(f"{url}/health").status_code == 200  # /health needs no established slot
    finally:
        for client in clients:
            client.close()
    wait_for(lambda: httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200, 5, "a free connection")


def test_a_body_sent_too_slowly_gets_a_408_and_the_connection_closes(keyed_server):
    sock = socket.create_connection(("127.0.0.1", _port(keyed_server)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + b'{"prompt": "')
    sock.settimeout(BODY_TIMEOUT + 10)
    started, answer = time.monotonic(), b""
    try:
        while chunk := sock.recv(1 << 16):  # read until the server closes the connection
            answer += chunk
    finally:
        sock.close()
    elapsed = time.monotonic() - started
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), answer[:500]
    assert json.loads(body)["error"]["message"].startswith("the request body did not arrive within")
    print(f"408 after {elapsed:.2f} s")
    assert BODY_TIMEOUT <= elapsed < BODY_TIMEOUT + 3


class _FakeStream:
    """A RequestStream that produces `count` outputs as fast as the loop lets it."""

    def __init__(self, count: int) -> None:
        self.count = count

    async def __aiter__(self):
        for i in range(self.count):
            await asyncio.sleep(0)
            yield i


def test_a_reader_that_falls_behind_holds_one_output_per_stream():
    """Outputs are cumulative: a reader that comes back after a while gets each stream's newest, not a backlog."""

    async def read_late() -> list[tuple[int, int]]:
        merged = merge([_FakeStream(1000), _FakeStream(1000)])
        first = await anext(merged)
        await asyncio.sleep(0.5)  # both streams finish while the reader is away
        return [first] + [item async for item in merged]

    items = asyncio.run(read_late())
    print(items)
    assert sorted(items[1:]) == [(0, 999), (1, 999)]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"VmRSS:\s+(\d+)", status.read()).group(1)) / 1024


def _start_stream_nobody_reads(url: str) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: backpressure comes sooner
    sock.connect(("127.0.0.1", _port(url)))
    body = json.dumps(LONG_STREAM).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def test_a_client_that_stops_reading_is_cut_off_and_its_request_aborted(long_checkpoint_dir, tmp_path):
    send_timeout = 1.0
    log = tmp_path / "server.log"
    process, url = start_server_process(long_checkpoint_dir, *cli_flags(**LONG_ARGS, send_timeout=send_timeout),
                                        log_path=str(log))
    try:
        sock = _start_stream_nobody_reads(url)
        wait_for(lambda: metric(url, "vllm:num_requests_running") == 1, 30, "the stream to start")
        bystander = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=60)
        assert bystander.status_code == 200 and bystander.json()["usage"]["completion_tokens"] == 8
        started = time.monotonic()
        wait_for(lambda: metric(url, "vllm:num_requests_running") == 0, send_timeout + 8, "the stream's abort")
        print(f"aborted {time.monotonic() - started:.1f} s after the bystander")
        wait_for(lambda: metric(url, "vllm:num_free_kv_blocks") == LONG_ARGS["num_gpu_blocks_override"], 5,
                 "its KV blocks")
        generated = metric(url, "vllm:generation_tokens_total")
        assert generated < LONG_STREAM["max_tokens"], generated  # cut off, not finished
        assert _reset_by_server(sock)
        # The first round compiled its shapes (by how much depends on the host's XLA: 35 MB here, 140 on CI's);
        # later rounds must not grow the process: nothing of a cut-off stream may stay behind.
        before = _rss_mb(process.pid)
        for _ in range(2):
            sock = _start_stream_nobody_reads(url)
            wait_for(lambda: metric(url, "vllm:num_requests_running") == 1, 30, "the stream to start")
            wait_for(lambda: metric(url, "vllm:num_requests_running") == 0, send_timeout + 8, "the stream's abort")
            assert _reset_by_server(sock)
        print(f"RSS {before:.0f} -> {_rss_mb(process.pid):.0f} MB after two more streams cut off")
        assert _rss_mb(process.pid) - before < 16
    finally:
        stop_server_process(process)
    text = log.read_text()
    assert "disconnected a client that read none" in text and "Traceback" not in text, text[-3000:]


def test_sigterm_ends_within_the_shutdown_timeout_beside_a_client_that_does_not_read(long_checkpoint_dir,
                                                                                      tmp_path):
    shutdown_timeout = 2.0
    log = tmp_path / "server.log"
    process, url = start_server_process(
        long_checkpoint_dir, *cli_flags(**LONG_ARGS, send_timeout=120, shutdown_timeout=shutdown_timeout),
        log_path=str(log))
    try:
        sock = _start_stream_nobody_reads(url)
        wait_for(lambda: metric(url, "vllm:num_requests_running") == 1, 30, "the stream to start")
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=shutdown_timeout + 30)
        elapsed = time.monotonic() - started
        print(f"exited {status} {elapsed:.1f} s after SIGTERM")
        assert status == 0 and elapsed < shutdown_timeout + 10
        assert _reset_by_server(sock)
    finally:
        process.kill()
    text = log.read_text()
    assert "disconnecting 1 connections still open" in text and "Traceback" not in text, text[-3000:]
