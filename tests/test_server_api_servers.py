"""`jax-engine serve --api-server-count N`: N API server processes on one engine core (server/api_servers.py).

Real servers on 127.0.0.1 with the tiny checkpoint: clients on many connections read what the in-process engine
makes, whichever API server took their connection; /metrics sums every API server's counts; a SIGTERM drains
them all and exits 0; the core's death ends them all and exits 1; flags that cannot work are refused before
anything loads.
"""

import concurrent.futures
import json
import os
import signal
import socket

import httpx
import openai
import pytest
from prometheus_client.mmap_dict import MmapedDict

from jax_engine import LLM, SamplingParams, cli
from jax_engine.engine_core.launch import CORE_MODULE, MULTIPROCESSING_ENV
from jax_engine.server.api_servers import API_SERVER_MODULE
from jax_engine.server.server_config import LOG_STATS_INTERVAL_ENV
from tests.server_helpers import (TINY_ENGINE_ARGS, child_processes, cli_flags, events_after, maps_jaxlib,
                                  metric, start_server_process, stop_server_process, wait_for, wait_for_api_servers)
from tests.test_engine_core import LONG, _gone

ARGS = {**TINY_ENGINE_ARGS, "num_gpu_blocks_override": 520, "max_model_len": 4096}
PROMPTS = [f"request {i} says hello to the" for i in range(16)]


def _children(supervisor_pid: int, module: str) -> list[int]:
    return [pid for pid, cmdline in child_processes(supervisor_pid) if module in cmdline]


def _start(checkpoint_dir: str, log_path, count: int = 2, env: dict | None = None):
    return start_server_process(checkpoint_dir, "--api-server-count", str(count), *cli_flags(**ARGS),
                                "--served-model-name", "tiny", log_path=str(log_path), env=env)


def _served_prompt_tokens(api_server_pid: int) -> float:
    """The prompt tokens one API server counted, from its own multiprocess file (/metrics gives only the sum)."""
    with open(f"/proc/{api_server_pid}/environ", "rb") as environ:
        env = dict(item.split(b"=", 1) for item in environ.read().split(b"\0") if b"=" in item)
    path = os.path.join(env[b"PROMETHEUS_MULTIPROC_DIR"].decode(), f"counter_{api_server_pid}.db")
    return sum(value for key, value, *_ in MmapedDict.read_all_values_from_file(path)
               if json.loads(key)[0] == "vllm:prompt_tokens")


@pytest.fixture(scope="module")
def two_api_servers(long_checkpoint_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("api-servers") / "server.log"
    process, url = _start(long_checkpoint_dir, log, env={LOG_STATS_INTERVAL_ENV: "0.5"})
    wait_for_api_servers(log)
    yield process, url, log
    stop_server_process(process)
    assert process.returncode == 0
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def test_requests_on_many_connections_are_served_by_both_api_servers_as_in_process(two_api_servers,
                                                                                   long_checkpoint_dir):
    process, url, log = two_api_servers
    api_servers, cores = _children(process.pid, API_SERVER_MODULE), _children(process.pid, CORE_MODULE)
    assert len(api_servers) == 2 and len(cores) == 1

    def complete(prompt: str) -> str:  # a client of its own: a connection of its own
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(complete, PROMPTS))
    expected = LLM(long_checkpoint_dir, **ARGS).generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
    assert texts == [want.outputs[0].text for want in expected]
    prompt_tokens = sum(len(want.prompt_token_ids) for want in expected)
    served = [_served_prompt_tokens(pid) for pid in api_servers]
    assert sum(served) == prompt_tokens and all(served), served  # each API server took some of the connections
    for _ in range(4):  # whichever API server answers /metrics, it sums them all
        assert metric(url, "vllm:prompt_tokens_total") == prompt_tokens
    # Only the core runs the model: the API servers and the supervisor never import JAX (~1.4 s of CPU each).
    assert [maps_jaxlib(pid) for pid in (process.pid, *api_servers, *cores)] == [False, False, False, True]
    # The periodic stats line comes from the first API server alone, which counts the others' tokens too.
    wait_for(lambda: "api-server-0 jax_engine.server.stats_logger: Avg prompt" in log.read_text(), 10,
             "the first API server's stats line")
    assert "api-server-1 jax_engine.server.stats_logger" not in log.read_text()


def test_sigterm_drains_every_api_server_then_stops_the_core(long_checkpoint_dir, tmp_path):
    process, url = _start(long_checkpoint_dir, tmp_path / "log")
    children = [pid for pid, _ in child_processes(process.pid)]
    try:
        rest = events_after(url, {**LONG, "max_tokens": 300}, lambda: os.kill(process.pid, signal.SIGTERM))
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["usage"]["completion_tokens"] == 300  # all of it
        assert process.wait(timeout=60) == 0
        assert len(children) == 3 and all(_gone(pid) for pid in children)
    finally:
        process.kill()
    assert "Traceback" not in (tmp_path / "log").read_text()


def test_the_core_s_death_fails_requests_in_flight_and_exits_1(long_checkpoint_dir, tmp_path):
    process, url = _start(long_checkpoint_dir, tmp_path / "log")
    (core,) = _children(process.pid, CORE_MODULE)
    api_servers = _children(process.pid, API_SERVER_MODULE)
    try:
        rest = events_after(url, LONG, lambda: os.kill(core, signal.SIGKILL))
        assert json.loads(rest[-2])["error"]["code"] == "engine_dead"
        assert process.wait(timeout=60) == 1
        wait_for(lambda: all(_gone(pid) for pid in api_servers), 30, "the API servers to exit")
    finally:
        process.kill()
    log = (tmp_path / "log").read_text()
    assert "the engine core process exited with status -9: stopping the API servers" in log
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=5)


@pytest.mark.parametrize("flags, error", [
    (["--api-server-count", "0"], "--api-server-count must be at least 1 (got 0)"),
    (["--api-server-count", str(os.cpu_count() + 1)], "--api-server-count must be at most the"),
    (["--api-server-count", "2", "--no-engine-core-process"], "--api-server-count > 1 needs the engine core process"),
    (["--api-server-count", "2", "--engine-core-process", "--port", "{taken}"], "cannot listen there"),
])
def test_flags_that_cannot_work_are_refused_before_the_model_loads(flags, error, monkeypatch):
    monkeypatch.setenv(MULTIPROCESSING_ENV, "0")  # no core process started early, before the flags are parsed
    with socket.create_server(("127.0.0.1", 0)) as taken, pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "no-such-model", *[flag.format(taken=taken.getsockname()[1]) for flag in flags]])
    assert error in str(exit_.value.code)


def test_an_api_server_s_death_stops_the_others_and_the_core_and_exits_1(long_checkpoint_dir, tmp_path):
    process, url = _start(long_checkpoint_dir, tmp_path / "log")
    children = [pid for pid, _ in child_processes(process.pid)]
    try:
        os.kill(_children(process.pid, API_SERVER_MODULE)[0], signal.SIGKILL)
        assert process.wait(timeout=60) == 1
        assert len(children) == 3 and all(_gone(pid) for pid in children)
    finally:
        process.kill()
    assert "exited with status -9: stopping the others" in (tmp_path / "log").read_text()
