"""LoRA adapters over HTTP (issue 46): `jax-engine serve --enable-lora --lora-modules`, the request's `model` picking
the adapter, /v1/models listing them, and vLLM's run-time load / unload routes behind its environment switch, through
the official openai client."""

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest

from jax_engine.engine_core.launch import CORE_MODULE
from tests.server_helpers import (TINY_ENGINE_ARGS, child_processes, cli_flags, start_server_process,
                                  stop_server_process, wait_for_api_servers)
from tests.test_lora import write_huge_copy
from tests.test_lora_engine import adapters  # noqa: F401 (the fixture)

LORA_FLAGS = cli_flags(**TINY_ENGINE_ARGS, enable_lora=True, max_loras=2, max_lora_rank=8)
PROMPT = "ab"


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory):  # noqa: F811
    base, requests = adapters
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    modules = [f"{r.lora_name}={r.lora_path}" for r in requests[:2]]
    process, url = start_server_process(str(base), *LORA_FLAGS, "--lora-modules", *modules, log_path=str(log),
                                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    yield url, str(base), process
    stop_server_process(process)
    text = log.read_text()
    assert "Traceback" not in text and "_lora failed" not in text, text[-3000:]  # the core's adapter updates


def complete(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text


def test_the_request_model_picks_the_adapter(server, adapters):  # noqa: F811
    from jax_engine import LLM, SamplingParams

    url, base, _ = server
    _, requests = adapters
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    listed = client.models.list().data
    assert [m.id for m in listed] == [base, "a0", "a1"]
    assert listed[1].model_extra["parent"] == base and listed[1].model_extra["root"] == requests[0].lora_path
    answers = {model: complete(client, model) for model in (base, "a0", "a1")}
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, **TINY_ENGINE_ARGS)
    offline = llm.generate([PROMPT] * 3, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False,
                           lora_request=[None, *requests[:2]])
    assert list(answers.values()) == [o.outputs[0].text for o in offline]
    answer = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert answer.model == "a1"
    with pytest.raises(openai.BadRequestError, match="model 'a9' does not exist"):
        complete(client, "a9")


def test_adapters_are_loaded_and_unloaded_at_run_time(server, adapters, tmp_path):  # noqa: F811
    url, _, _ = server
    _, requests = adapters
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    load = {"lora_name": "a2", "lora_path": requests[2].lora_path}
    response = httpx.post(f"{url}/v1/load_lora_adapter", json=load)
    assert response.status_code == 200 and "added successfully" in response.text
    assert "a2" in [m.id for m in client.models.list().data] and complete(client, "a2")
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=load)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    missing = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert missing.status_code == 400 and "no adapter_config.json" in missing.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
    with pytest.raises(openai.BadRequestError, match="model 'a2' does not exist"):
        complete(client, "a2")
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"


def _strict_json(text: str):
    """JSON as the spec has it: Python's json reads NaN and Infinity, which other clients refuse."""
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_an_adapter_whose_rows_are_nan_is_answered_in_json(server, adapters, tmp_path):  # noqa: F811
    """An adapter of huge (finite) weights makes its own rows' logits NaN: their logprobs are reported as an
    impossible token's are (-9999.0), in JSON, streamed or not; a NaN made a 500 (json.dumps refuses it)."""
    url, _, _ = server
    _, requests = adapters
    huge = write_huge_copy(requests[0].lora_path, tmp_path / "huge")
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "huge", "lora_path": huge}).status_code == 200
    try:
        bodies = [("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2, "echo": True}),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                            "logprobs": True, "top_logprobs": 2, "prompt_logprobs": 1})]
        for route, body in bodies:
            answer = httpx.post(f"{url}{route}", json={"model": "huge", **body}, timeout=60)
            assert answer.status_code == 200, answer.text
            choice = _strict_json(answer.text)["choices"][0]
            logprobs = (choice["logprobs"]["token_logprobs"][1:] if "text" in choice
                        else [entry["logprob"] for entry in choice["logprobs"]["content"]])
            assert logprobs and set(logprobs) == {-9999.0}
            with httpx.stream("POST", f"{url}{route}", json={"model": "huge", "stream": True, **body}) as stream:
                events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all("error" not in _strict_json(e) for e in events[:-1])
    finally:
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "huge"}).status_code == 200


def test_lora_modules_need_enable_lora(adapters):  # noqa: F811
    base, requests = adapters
    result = subprocess.run([sys.executable, "-m", "jax_engine", "serve", str(base), "--lora-modules",
                             f"a0={requests[0].lora_path}"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--lora-modules needs --enable-lora" in result.stderr
    bad = subprocess.run([sys.executable, "-m", "jax_engine", "serve", str(base), "--lora-modules", "a0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "expected name=path" in bad.stderr


def test_adapters_are_served_by_the_engine_core_process(server):
    """The engine runs in a core process of its own with LoRA too: the API server checks adapters and the core loads
    them (engine_core/)."""
    _, _, process = server
    assert [cmdline for _, cmdline in child_processes(process.pid) if CORE_MODULE in cmdline]


def test_two_api_servers_serve_the_adapters_named_at_start_up(adapters, tmp_path):  # noqa: F811
    """With --api-server-count 2 each API server numbers the --lora-modules alike: requests for each adapter, on
    many connections (both API servers take some), get the in-process engine's answers."""
    import concurrent.futures

    from jax_engine import LLM, SamplingParams
    from jax_engine.server.api_servers import API_SERVER_MODULE
    from tests.test_server_api_servers import _children, _served_prompt_tokens

    base, requests = adapters
    modules = [f"{r.lora_name}={r.lora_path}" for r in requests[:2]]
    process, url = start_server_process(str(base), *LORA_FLAGS, "--lora-modules", *modules, "--api-server-count", "2",
                                        log_path=str(tmp_path / "server.log"))
    models = [str(base), "a0", "a1"] * 4
    try:
        wait_for_api_servers(tmp_path / "server.log")
        def complete_alone(model: str) -> str:  # a client of its own: a connection of its own
            return complete(openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), model)

        with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
            answers = list(pool.map(complete_alone, models))
        served = [_served_prompt_tokens(pid) for pid in _children(process.pid, API_SERVER_MODULE)]
    finally:
        stop_server_process(process)
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, **TINY_ENGINE_ARGS)
    offline = llm.generate([PROMPT] * 3, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False,
                           lora_request=[None, *requests[:2]])
    assert answers == [o.outputs[0].text for o in offline] * 4
    assert len(set(answers[:3])) == 3  # the adapters change the answer: a mix-up would show
    assert len(served) == 2 and all(served), served
    text = (tmp_path / "server.log").read_text()
    assert process.returncode == 0 and "Traceback" not in text and "_lora failed" not in text, text[-3000:]


def test_two_api_servers_refuse_run_time_adapter_updates(adapters):  # noqa: F811
    base, _ = adapters
    result = subprocess.run([sys.executable, "-m", "jax_engine", "serve", str(base), "--enable-lora",
                             "--api-server-count", "2"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    assert result.returncode == 1
    assert "--api-server-count > 1 serves the adapters of --lora-modules, not run-time LoRA updates" in result.stderr
