"""Data parallelism (jax_engine.server.data_parallel.py): two replicas of the default model behind one real
HTTP server, driven by the official openai client, against one engine; each replica on its own devices."""

import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import openai
import pytest

from jax_engine import LLM, EngineArgs, LLMEngine, SamplingParams
from jax_engine.server.data_parallel import DataParallelEngine
from jax_engine.server.server_config import ServerConfig
from tests.server_helpers import ThreadedServer, wait_for

ENGINE_ARGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
                   num_gpu_blocks_override=32, enforce_eager=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,", "Once upon a time",
           "The history of paged memory", "SELECT * FROM", "Water boils at", "My favourite colour is"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def expected(default_checkpoint) -> list[str]:
    """One engine's greedy texts of PROMPTS."""
    llm = LLM.from_engine(LLMEngine(EngineArgs(**ENGINE_ARGS), checkpoint=default_checkpoint))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def served(default_checkpoint):
    """(the DataParallelEngine of 2 replicas, an openai client of the server in front of it)."""
    args = EngineArgs(data_parallel_size=2, **ENGINE_ARGS)
    engine = DataParallelEngine.from_engine_args(args, checkpoint=default_checkpoint)
    with ThreadedServer(engine, ServerConfig("smol")) as server:
        yield engine, openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def complete(client: openai.OpenAI, prompt: str, **kwargs):
    return client.completions.create(model="smol", prompt=prompt, temperature=0, extra_body={"ignore_eos": True},
                                     **{"max_tokens": MAX_TOKENS, **kwargs})


def devices_of(replica) -> set:
    """Where a replica's weights and KV cache live."""
    runner = replica.engine.runner
    weights = [p[...] for p in (*runner.model.layers.values(), *runner.model.top.values())]
    return {device for array in (*weights, runner.k_cache, runner.v_cache) for device in array.devices()}


def test_concurrent_requests_spread_over_the_replicas_each_on_its_device(served, expected):
    engine, client = served
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda prompt: complete(client, prompt).choices[0].text, PROMPTS))
    assert texts == expected
    assert all(replica.engine.num_steps > 0 for replica in engine.replicas)
    # The KV cache is each step's output: it stays on device r only if replica r's steps ran there.
    assert [devices_of(replica) for replica in engine.replicas] == [{jax.devices()[0]}, {jax.devices()[1]}]
    # /metrics: each replica's counters, under its engine label.
    metrics = httpx.get(str(client.base_url).removesuffix("v1/") + "metrics").text
    queries = {re.search(r'engine="(\d+)"', labels).group(1): float(value) for labels, value in re.findall(
        r'^vllm:prefix_cache_queries_total\{(.*model_name="smol".*)\} (\S+)$', metrics, re.MULTILINE)}
    assert queries == {str(r): replica.engine.stats()["prefix_cache_queries"] for r, replica in enumerate(engine.replicas)}
    assert all(queries.values())  # both replicas served prompts


def test_an_abandoned_stream_frees_its_replica_and_spares_the_other(served, expected):
    engine, client = served
    stream = complete(client, PROMPTS[0], max_tokens=100, stream=True)  # both idle: replica 0
    next(iter(stream))
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(complete, client, PROMPTS[1])  # replica 0 holds one request: replica 1
        wait_for(lambda: engine.replicas[1].engine.get_num_unfinished_requests() == 1, 30, "replica 1's request")
        stream.close()
        assert other.result().choices[0].text == expected[1]
    wait_for(lambda: all(r.engine.get_num_unfinished_requests() == 0 for r in engine.replicas), 30, "the abort")
    assert not engine._replica_of  # every request forgotten by the front


def test_a_dead_replica_fails_its_requests_then_the_server_shuts_down(default_checkpoint, expected):
    """As with one engine (tests/test_server_robustness.py), while the other replica finishes its own."""
    engine = DataParallelEngine.from_engine_args(EngineArgs(data_parallel_size=2, **ENGINE_ARGS),
                                                 checkpoint=default_checkpoint)

    def broken_device(inputs):
        raise RuntimeError("simulated device failure")

    engine.replicas[1].engine.runner.execute = broken_device
    with ThreadedServer(engine, ServerConfig("smol")) as server:
        release, shut_down = threading.Event(), engine.on_dead  # hold the shutdown until the checks are done
        engine.on_dead = lambda: threading.Thread(target=lambda: (release.wait(30), shut_down())).start()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        stream = iter(complete(client, PROMPTS[0], max_tokens=40, stream=True))  # both idle: replica 0
        first = next(stream).choices[0].text
        with pytest.raises(openai.APIStatusError) as failed:  # replica 0 holds one request: replica 1
            complete(client, PROMPTS[1])
        assert failed.value.status_code == 503 and "simulated" not in failed.value.message
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}).status_code == 503
        assert (first + "".join(chunk.choices[0].text for chunk in stream)).startswith(expected[0])
        release.set()
        server.thread.join(timeout=30)
        assert not server.thread.is_alive()


def test_data_parallel_times_tensor_parallel_takes_consecutive_devices(default_checkpoint, expected):
    args = EngineArgs(data_parallel_size=2, tensor_parallel_size=2, **ENGINE_ARGS)
    engine = DataParallelEngine.from_engine_args(args, checkpoint=default_checkpoint)
    devices = jax.devices()
    assert [devices_of(replica) for replica in engine.replicas] == [set(devices[:2]), set(devices[2:])]
    llm = LLM.from_engine(engine.replicas[1].engine)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].text == expected[0]


def test_data_parallel_size_is_refused_where_it_cannot_be_served():
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        EngineArgs(data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size > 1 .* is served by `jax-engine serve`"):
        LLM(data_parallel_size=2)
    with pytest.raises(ValueError, match=r"data_parallel_size \* tensor_parallel_size must be <= the number of "
                                         r"devices \(4: cpu\), got 3 \* 2 = 6"):
        DataParallelEngine.from_engine_args(EngineArgs(data_parallel_size=3, tensor_parallel_size=2))
    # `jax-engine serve --data-parallel-size` reaches DataParallelEngine (which refuses 5 replicas of 4 devices).
    run = subprocess.run([sys.executable, "-m", "jax_engine", "serve", "--data-parallel-size", "5"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "data_parallel_size * tensor_parallel_size" in run.stderr


def test_serve_runs_each_replica_in_an_engine_core_process_of_its_own(tiny_checkpoint_dir, tmp_path):
    """`jax-engine serve --data-parallel-size 2`: two core processes, one per replica on its own device (a core
    per data-parallel rank, as vLLM runs them), answering as one engine in the server's process does."""
    from jax_engine.engine_core.launch import CORE_MODULE
    from tests.server_helpers import TINY_ENGINE_ARGS, child_processes, cli_flags, start_server_process, \
        stop_server_process

    process, url = start_server_process(tiny_checkpoint_dir, "--data-parallel-size", "2", "--served-model-name",
                                        "tiny", *cli_flags(**TINY_ENGINE_ARGS), log_path=str(tmp_path / "log"))
    try:
        cores = [cmdline for _, cmdline in child_processes(process.pid) if CORE_MODULE in cmdline]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(lambda p: client.completions.create(
                model="tiny", prompt=p, max_tokens=8, temperature=0, stop=["e"]).choices[0].text, PROMPTS))
        want = LLM(tiny_checkpoint_dir, **TINY_ENGINE_ARGS).generate(
            PROMPTS, SamplingParams(max_tokens=8, temperature=0, stop=["e"]), use_tqdm=False)
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        stop_server_process(process)
    assert len(cores) == 2 and process.returncode == 0
    assert texts == [o.outputs[0].text for o in want]
    queries = dict(re.findall(r'^vllm:prefix_cache_queries_total\{.*engine="(\d+)".*\} (\S+)$', metrics, re.MULTILINE))
    assert sorted(queries) == ["0", "1"] and all(float(q) > 0 for q in queries.values())  # both served prompts
    log = (tmp_path / "log").read_text()
    assert "engine-core-dp0" in log and "engine-core-dp1" in log and "Traceback" not in log


def _serve_replicas_behind_api_servers(checkpoint_dir: str, log_path):
    """`jax-engine serve --data-parallel-size 2 --api-server-count 2` on the tiny checkpoint, every API server
    accepting; (process, url, core pids, API server pids)."""
    from jax_engine.engine_core.launch import CORE_MODULE
    from jax_engine.server.api_servers import API_SERVER_MODULE
    from tests.server_helpers import TINY_ENGINE_ARGS, child_processes, cli_flags, start_server_process, \
        wait_for_api_servers

    process, url = start_server_process(checkpoint_dir, "--data-parallel-size", "2", "--api-server-count", "2",
                                        "--served-model-name", "tiny", *cli_flags(**TINY_ENGINE_ARGS),
                                        log_path=str(log_path))
    wait_for_api_servers(log_path)
    children = child_processes(process.pid)
    return (process, url, [pid for pid, cmdline in children if CORE_MODULE in cmdline],
            [pid for pid, cmdline in children if API_SERVER_MODULE in cmdline])


def test_several_api_servers_share_every_replica_s_core(tiny_checkpoint_dir, tmp_path):
    """Two API servers, each a client of both replicas' cores, each sending a request to the core with the fewest
    unfinished requests of both API servers (vLLM's DP x API server layout): answers as one engine's, both
    replicas and both API servers served, and a SIGTERM drains them all (status 0)."""
    from tests.server_helpers import TINY_ENGINE_ARGS, stop_server_process
    from tests.test_server_api_servers import _served_prompt_tokens

    prompts = [f"request {i} says hello to the" for i in range(16)]
    process, url, cores, api_servers = _serve_replicas_behind_api_servers(tiny_checkpoint_dir, tmp_path / "log")
    try:
        def complete(prompt: str) -> str:  # a client of its own: a connection of its own
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(complete, prompts))
        served = [_served_prompt_tokens(pid) for pid in api_servers]
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        stop_server_process(process)
    assert len(cores) == 2 and len(api_servers) == 2 and process.returncode == 0
    want = LLM(tiny_checkpoint_dir, **TINY_ENGINE_ARGS).generate(prompts, SamplingParams(max_tokens=8, temperature=0),
                                                                 use_tqdm=False)
    assert texts == [o.outputs[0].text for o in want]
    assert sum(served) == sum(len(o.prompt_token_ids) for o in want) and all(served), served
    queries = dict(re.findall(r'^vllm:prefix_cache_queries_total\{.*engine="(\d+)".*\} (\S+)$', metrics, re.MULTILINE))
    assert sorted(queries) == ["0", "1"] and all(float(q) > 0 for q in queries.values())  # both replicas served
    log = (tmp_path / "log").read_text()
    assert "2 API servers on 127.0.0.1" in log and "2 engine cores" in log and "Traceback" not in log


def test_one_replica_s_core_dying_stops_every_api_server_and_core(tiny_checkpoint_dir, tmp_path):
    from tests.test_engine_core import _gone

    process, url, cores, api_servers = _serve_replicas_behind_api_servers(tiny_checkpoint_dir, tmp_path / "log")
    try:
        os.kill(cores[1], signal.SIGKILL)
        assert process.wait(timeout=60) == 1
        wait_for(lambda: all(_gone(pid) for pid in [*cores, *api_servers]), 30, "every process to exit")
    finally:
        process.kill()
    assert "the engine core process exited with status -9: stopping the API servers" in (tmp_path / "log").read_text()
