"""Real HTTP servers on 127.0.0.1 for tests: `jax-engine serve` in a subprocess, or uvicorn in a thread
(when a test needs to reach into the engine it serves)."""

import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

from collections.abc import Callable, Iterator

import httpx


# The engine of every tiny-checkpoint server test: starts in seconds, holds 4 streams of up to 128 tokens.
# Servers in tests compile on first use (enforce_eager): start-up compiles are tested in test_compile_shapes.py
# and by the docs' openai_client example.
TINY_ENGINE_ARGS = {"num_gpu_blocks_override": 64, "block_size": 8, "max_model_len": 128, "max_num_seqs": 4,
                    "max_num_batched_tokens": 64, "enforce_eager": True}


def cli_flags(**options) -> list[str]:
    """`jax-engine serve` flags for keyword options: max_model_len=128 -> --max-model-len 128, False -> --no-..."""
    flags = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True or value is False:
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, timeout: float, process: subprocess.Popen | None = None,
                       verify: ssl.SSLContext | bool = True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1, verify=verify).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy in {timeout} s")


def start_server_process(*args: str, log_path: str, command: tuple[str, ...] = ("-m", "jax_engine", "serve"),
                         env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m jax_engine serve ARGS` on a free port; returns (process, base url) once /health answers."""
    port = free_port()
    log = open(log_path, "w")
    process = subprocess.Popen([sys.executable, *command, "--port", str(port), *args], stdout=log,
                               stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, timeout=180, process=process)
    except BaseException:
        process.kill()
        raise
    return process, url


def stop_server_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def child_processes(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is `pid`."""
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append((int(entry), cmdline.read().replace(b"\0", b" ").decode()))
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
    return children


def maps_jaxlib(pid: int) -> bool:
    """Whether process `pid` has JAX's compiled libraries (jaxlib/*.so) mapped: whether it imported JAX."""
    with open(f"/proc/{pid}/maps") as maps:
        return any("/jaxlib/" in line for line in maps)


class ThreadedServer:
    """The server `jax-engine serve` runs (uvicorn with the same settings), from a thread of the test process."""

    def __init__(self, engine, config) -> None:
        from jax_engine.server.serve import make_server

        self.port = free_port()
        # A test's self-signed certificate is its own authority.
        self.verify = ssl.create_default_context(cafile=config.ssl_certfile) if config.ssl_certfile else True
        self.url = f"{'https' if config.ssl_certfile else 'http'}://127.0.0.1:{self.port}"
        self.server = make_server(engine, config, "127.0.0.1", self.port, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ThreadedServer":
        self.thread.start()
        wait_until_healthy(self.url, timeout=60, verify=self.verify)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """One value from /metrics (the first sample of `name`)."""
    text = httpx.get(f"{url}/metrics", headers=headers).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def wait_for_api_servers(log_path, count: int = 2) -> None:
    """Until every API server of --api-server-count logged its start. They start accepting together
    (server/start_barrier.py), but /health answers once one accepts, and uvicorn's own start-up takes each a few
    milliseconds more or less: a test of how connections split needs all of them accepting."""
    wait_for(lambda: Path(log_path).read_text().count("Application startup complete") == count, 60,
             f"{count} API servers to start")


def data_lines(response: httpx.Response) -> Iterator[str]:
    """The data of a streamed response's server-sent events."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


def events_after(url: str, body: dict, action: Callable[[], None], timeout: float = 120) -> list[str]:
    """Stream a completion; once its first event has come, do `action`; return the events that follow."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as response:
        events = data_lines(response)
        next(events)
        action()
        return list(events)
