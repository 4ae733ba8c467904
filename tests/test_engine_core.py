"""`jax-engine serve --engine-core-process`: the scheduler and the model in a process of their own (engine_core/).

Real servers on 127.0.0.1 with the tiny checkpoint: what a client reads is what the in-process engine makes, the
queue limit counts requests on their way to the core, and the core's death or a SIGTERM to the whole process
group (as systemd sends it) end the server as they do with one process.
"""

import asyncio
import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import zmq

from jax_engine import LLM, EngineArgs, SamplingParams
from jax_engine.engine_core.core import LAST_WORD_MS
from jax_engine.engine_core.core_client import EngineCoreClient
from jax_engine.engine_core.launch import CORE_MODULE
from jax_engine.engine_core.messages import decode, encode
from tests.server_helpers import (TINY_ENGINE_ARGS, child_processes, cli_flags, data_lines, events_after, metric,
                                  start_server_process, stop_server_process, wait_for)

# One running request at a time; room for streams long enough (4000 tokens, seconds) to act on while they run.
ARGS = {**TINY_ENGINE_ARGS, "max_num_seqs": 1, "num_gpu_blocks_override": 520, "max_model_len": 4096}
LONG = {"prompt": "hello there", "max_tokens": 4000, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}


def _core_pid(server_pid: int) -> int:
    (pid,) = [pid for pid, cmdline in child_processes(server_pid) if CORE_MODULE in cmdline]
    return pid


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except OSError:
        return True


def _start(checkpoint_dir: str, log_path, **server_flags):
    return start_server_process(checkpoint_dir, "--engine-core-process", *cli_flags(**ARGS, **server_flags),
                                log_path=str(log_path))


@pytest.fixture(scope="module")
def core_server(long_checkpoint_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("core-server") / "server.log"
    process, url = _start(long_checkpoint_dir, log, max_waiting_requests=2, served_model_name="tiny")
    yield process, url
    stop_server_process(process)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def test_the_core_runs_apart_and_answers_as_the_engine_in_process(core_server, long_checkpoint_dir):
    process, url = core_server
    assert _core_pid(process.pid)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    prompts = ["hello there", "the quick brown fox"]
    answer = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0,
                                       logprobs=2, seed=0)
    expected = LLM(long_checkpoint_dir, **ARGS).generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                                                  logprobs=2))
    for choice, want in zip(sorted(answer.choices, key=lambda c: c.index), expected):
        assert choice.text == want.outputs[0].text
        assert choice.logprobs.tokens == [want.outputs[0].logprobs[i][t].decoded_token
                                          for i, t in enumerate(want.outputs[0].token_ids)]
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="tiny", prompt=prompts[0], max_tokens=12, temperature=0, stream=True))
    assert streamed == expected[0].outputs[0].text
    # Stop strings are found in the API server, which makes the text: the same cut, streamed or not.
    text = expected[1].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    stopped = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[: text.index(stop)] and stopped.choices[0].finish_reason == "stop"
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="tiny", prompt=prompts[1], max_tokens=12, temperature=0, stop=[stop], stream=True))
    assert streamed == text[: text.index(stop)]


def test_a_full_queue_answers_503_and_aborts_reach_the_core(core_server):
    """max_num_seqs 1 and max_waiting_requests 2: a running request, two waiting, then a 503."""
    _, url = core_server
    with contextlib.ExitStack() as streams:
        running = streams.enter_context(httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60))
        running_events = data_lines(running)
        next(running_events)
        for _ in range(2):
            waiting = streams.enter_context(httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60))
            assert waiting.status_code == 200
        refused = httpx.post(f"{url}/v1/completions", json={**LONG, "stream": False}, timeout=10)
        assert refused.status_code == 503 and "Retry-After" in refused.headers
    # Leaving the streams aborted their requests in the core: the queue takes requests again.
    wait_for(lambda: httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                timeout=30).status_code == 200, 30, "the aborted requests to leave the core")


def test_a_cache_salt_keeps_prefix_hits_apart_across_the_process_boundary(core_server):
    """cache_salt travels with the prompt to the core, whose prefix cache hits only the same salt's blocks."""
    _, url = core_server
    body = {"prompt": "a salted system prompt of several blocks, sent to the core again", "max_tokens": 2}

    def hits_after(salt: str | None) -> float:
        response = httpx.post(f"{url}/v1/completions", json={**body, "cache_salt": salt}, timeout=60)
        assert response.status_code == 200, response.text
        return metric(url, "vllm:prefix_cache_hits_total")

    cold = hits_after("a")
    assert hits_after("b") == cold and hits_after(None) == cold  # another salt, or none: no hit
    assert hits_after("a") > cold  # the same salt hits


def test_the_server_exits_1_when_the_core_dies(long_checkpoint_dir, tmp_path):
    """Killing the core fails the requests in flight (an SSE error), and the server exits 1 for its supervisor."""
    process, url = _start(long_checkpoint_dir, tmp_path / "log")
    try:
        rest = events_after(url, LONG, lambda: os.kill(_core_pid(process.pid), signal.SIGKILL))
        assert json.loads(rest[-2])["error"]["code"] == "engine_dead"
        assert process.wait(timeout=60) == 1
    finally:
        process.kill()
    log = (tmp_path / "log").read_text()
    assert "engine core process exited with status -9" in log and "shutting the server down" in log


def test_sigterm_to_the_process_group_drains_then_stops_the_core(long_checkpoint_dir, tmp_path):
    process, url = _start(long_checkpoint_dir, tmp_path / "log")
    core = _core_pid(process.pid)
    try:
        def terminate_the_group():  # what systemd or Ctrl-C deliver: the signal to every process of the group
            for pid in (process.pid, core):
                os.kill(pid, signal.SIGTERM)

        rest = events_after(url, {**LONG, "max_tokens": 500}, terminate_the_group)
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["usage"]["completion_tokens"] == 500  # all of it
        assert process.wait(timeout=60) == 0
        wait_for(lambda: _gone(core), 30, "the engine core to exit")
    finally:
        process.kill()
    assert "Traceback" not in (tmp_path / "log").read_text()


@pytest.fixture(scope="module")
def core_client(long_checkpoint_dir):
    """An API server's client of a core process of its own, driven by hand; under the "priority" scheduling policy,
    which serves requests of priority 0 (the default) as "fcfs" does."""
    client = EngineCoreClient(EngineArgs(long_checkpoint_dir, scheduling_policy="priority", **ARGS))
    yield client
    client.shutdown()


def _outputs_until(client: EngineCoreClient, done) -> list:
    """Every output the core sends until `done(outputs so far)`."""
    async def receive():
        outputs = []
        while not done(outputs):
            outputs += await client.next_outputs(asyncio.Event())
        return outputs

    return asyncio.run(receive())


def test_adds_count_as_waiting_until_the_core_reports_them(core_client):
    """The queue limit sees a request from the moment it is sent, not only once the core has reported it."""
    client = core_client
    params = SamplingParams(max_tokens=4, temperature=0)
    for i in range(3):
        client.add_request(f"r{i}", {"prompt": None, "prompt_token_ids": [1, 2, 3]}, params)
    assert client.num_waiting_sequences() == 3  # nothing reported yet: all three on their way

    def all_finished(outputs):
        finished = sum(o.finished for o in outputs)
        assert client.num_waiting_sequences() + client.num_running_sequences() + finished == 3
        return finished == 3

    _outputs_until(client, all_finished)
    assert client.num_waiting_sequences() == 0 and not client.has_unfinished_requests()


def test_a_priority_crosses_to_the_core_whose_scheduler_serves_it_first(core_client):
    """While the one seat (max_num_seqs=1) is taken, requests of priority 5 and then -5 wait in the core's
    scheduler: the second runs first."""
    client, prompt = core_client, {"prompt": None, "prompt_token_ids": [5, 6, 7]}
    client.add_request("seat", prompt, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    _outputs_until(client, lambda outputs: len(outputs) > 0)  # it runs
    for request_id, priority in (("later", 5), ("sooner", -5)):
        client.add_request(request_id, prompt, SamplingParams(max_tokens=2, temperature=0), priority=priority)
    outputs = _outputs_until(client, lambda outputs: sum(o.finished for o in outputs) == 3)
    assert [o.request_id for o in outputs if o.finished] == ["seat", "sooner", "later"]


def test_a_stop_string_found_in_the_api_server_stops_the_request_in_the_core(core_client):
    """The core makes no text: the API server finds the stop string, and the core stops the request at its word
    instead of making the 4000 tokens it asked for."""
    client, prompt = core_client, {"prompt": None, "prompt_token_ids": [5, 6, 7]}
    client.add_request("free", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    [free] = _outputs_until(client, lambda outputs: any(o.finished for o in outputs))[-1:]
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    steps_before = client.stats()["num_steps"]
    client.add_request("stopped", prompt, SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True, stop=stop))
    [stopped] = _outputs_until(client, lambda outputs: any(o.finished for o in outputs))[-1:]
    assert stopped.outputs[0].text == text[: text.index(stop)] and stopped.outputs[0].stop_reason == stop
    assert stopped.outputs[0].token_ids == free.outputs[0].token_ids[: len(stopped.outputs[0].token_ids)]
    assert not client.has_unfinished_requests()
    _outputs_until(client, lambda _: client.num_running_sequences() == 0)
    assert client.stats()["num_steps"] - steps_before < 20  # the core took the stop within a few steps


def test_allowed_token_ids_cross_to_the_core_as_their_mask(core_client, monkeypatch):
    """A request may list 2^20 allowed token ids: pickled, 2-5 MB that the core's loop, which every running request
    waits for, took 14-60 ms to unpickle and ~40 to check again. The API server made their mask when it checked the
    request: the core gets the mask alone (vocab_size / 8 bytes) and samples only among the ids."""
    client, prompt = core_client, {"prompt": None, "prompt_token_ids": [5, 6, 7]}
    ids = [7, 11] * 2**19
    _, _, params = client.validate_request(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=0,
                                                                  allowed_token_ids=ids))
    sizes, send = [], client._send
    monkeypatch.setattr(client, "_send", lambda kind, body: (sizes.append(len(encode(kind, body))), send(kind, body)))
    client.add_request("allowed", prompt, params)
    [output] = _outputs_until(client, lambda outputs: any(o.finished for o in outputs))[-1:]
    assert len(output.outputs[0].token_ids) == 8 and set(output.outputs[0].token_ids) <= {7, 11}
    assert sizes[0] < 16 * 1024 and len(params.allowed_token_ids) == 2**20  # the API server's copy keeps them


def test_a_grammar_is_built_off_the_cores_loop_and_an_abort_meanwhile_still_ends_it(core_client):
    """A matcher does not pickle: the core builds each grammar again from its text, ~0.9 s for 3,000 optional
    properties. On the core's loop that stopped every other request's steps for as long; now the running
    request's outputs keep coming while two such grammars build, and the request aborted while its grammar was
    building still ends with its last output, as any abort does."""

    client, prompt = core_client, {"prompt": None, "prompt_token_ids": [5, 6, 7]}
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    _, _, params = client.validate_request(prompt, SamplingParams(max_tokens=2, temperature=0,
                                                                  structured_outputs={"json": wide}))
    started = time.perf_counter()
    client.grammar_compiler.from_text(params.compiled_grammar.text)  # what the core does again for each
    build_seconds = time.perf_counter() - started
    client.add_request("running", prompt, SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True))
    _outputs_until(client, lambda outputs: len(outputs) > 2)
    client.add_request("grammar", prompt, params)
    client.add_request("aborted", prompt, params)
    client.abort_request(["aborted"])
    arrivals, window_end = [], time.perf_counter() + 2.5 * build_seconds  # both builds, one after the other

    def window_over(outputs):
        arrivals.append(time.perf_counter())
        return arrivals[-1] > window_end

    outputs = _outputs_until(client, window_over)
    client.abort_request(["running"])  # one running request at a time: the grammar's request runs after it
    outputs += _outputs_until(client, lambda more: sum(o.finished for o in outputs + more) == 3)
    finals = {o.request_id: o for o in outputs if o.finished}
    worst_gap = max(b - a for a, b in zip(arrivals, arrivals[1:]))
    print(f"builds of {build_seconds:.2f} s each; the running request's worst wait for an output {worst_gap:.3f} s")
    assert worst_gap < build_seconds / 2
    assert [c.finish_reason for c in finals["aborted"].outputs] == ["abort"]
    assert finals["grammar"].outputs[0].token_ids  # it joined the engine and ran (its grammar may end it early:
    # 3,000 optional keys open 12,007 alternatives after "{", past the parser's row limit)
    assert not client.has_unfinished_requests()


@pytest.mark.parametrize("flags, error", [
    ([], "model='{missing}' is neither a .gguf file nor a checkpoint directory"),
    (["--no-engine-core-process"], "model='{missing}' is neither a .gguf file nor a checkpoint directory"),
    (["--api-server-count", "2"], "model='{missing}' is neither a .gguf file nor a checkpoint directory"),
    (["--model", "{tiny}", "--data-parallel-size", "2"], "data_parallel_size * tensor_parallel_size must be <="),
], ids=["core", "in-process", "api-servers", "replicas"])
def test_an_engine_its_flags_cannot_start_ends_serve_with_the_error_in_a_line(tiny_checkpoint_dir, tmp_path, flags,
                                                                              error):
    """What the engine core refuses (a model path that is not there, data parallelism on one CPU device) ends
    `jax-engine serve` as a bad flag does: status 1 and the engine's own error, no traceback, no hang."""
    missing = str(tmp_path / "no-such-model.gguf")
    values = dict(missing=missing, tiny=tiny_checkpoint_dir)
    command = [sys.executable, "-m", "jax_engine", "serve", "--model", missing, "--port", "0",
               *[flag.format(**values) for flag in flags]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"jax-engine: error: {error.format(**values)}" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_a_core_that_cannot_start_waits_for_an_api_server_still_importing(tmp_path):
    """The API servers beside a core (--api-server-count) bind their sockets only after their imports, seconds on a
    busy machine: a core that refuses its model must still be heard then, not drop its word after LAST_WORD_MS
    (serve then printed the supervisor's "exited with status 1" instead of the engine's error)."""
    inputs, outputs = f"ipc://{tmp_path}/inputs", f"ipc://{tmp_path}/outputs"
    core = subprocess.Popen([sys.executable, "-m", CORE_MODULE], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    core.stdin.buffer.write(pickle.dumps((EngineArgs(model=str(tmp_path / "missing.gguf")), [(inputs, outputs)],
                                          "INFO")))
    core.stdin.close()
    context = zmq.Context()
    try:
        while "the engine core cannot start" not in core.stderr.readline():  # it has refused, and sent its word
            assert core.poll() is None, "the core exited without saying why it cannot start"
        time.sleep(LAST_WORD_MS / 1000 + 1)  # an API server slower than the old linger
        late = context.socket(zmq.PULL)
        late.bind(outputs)
        assert late.poll(30_000), "the core's word never came"
        kind, body = decode(late.recv())
        assert kind == "refused" and "is neither a .gguf file nor a checkpoint directory" in body
        assert core.wait(30) == 1
    finally:
        context.destroy(linger=0)
        core.kill()
        core.wait()
        core.stderr.close()
