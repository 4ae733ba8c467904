"""A server in a child process for a benchmark: started on a free port, measured once /health answers 200, stopped
when the benchmark is done with it. Used for our `jax-engine serve` and for llama.cpp's `llama-server` alike (both
take --port, and both answer /health with 200 only once the model is loaded)."""

import contextlib
import os
import pathlib
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx


@dataclass
class RunningServer:
    url: str
    ready_seconds: float  # from the process's start to its first 200 from /health


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def server_process(command: list[str], log_path: pathlib.Path, timeout: float = 600) -> Iterator[RunningServer]:
    """`command --port N` on a free port N, its output in `log_path`; yields it once healthy, then stops it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        started = time.monotonic()
        process = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            while not healthy(url):
                if process.poll() is not None or time.monotonic() - started > timeout:
                    raise RuntimeError(f"{command[0]} did not start: see {log_path}")
                time.sleep(0.2)
            yield RunningServer(url, time.monotonic() - started)
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
