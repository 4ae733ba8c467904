"""Two hosts on 127.0.0.1: `jax-engine serve` on node_rank 0 (the driver: HTTP in the API server, the scheduler
and block manager in its engine core process) and `jax-engine serve --headless` on node_rank 1 (a worker), one
JAX runtime over both through jax.distributed with gloo collectives, one model split over the devices of both.
The official openai client gets the same greedy text as the unsplit model (also through two API servers on the
driver's core), and stopping the driver releases the worker."""

import os
import subprocess
import sys

import openai
import pytest

from jax_engine import SamplingParams
from jax_engine.engine_core.launch import CORE_MODULE
from tests.server_helpers import (TINY_ENGINE_ARGS, child_processes, cli_flags, free_port, start_server_process,
                                  stop_server_process)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "A paged KV cache"]
ENGINE = {**TINY_ENGINE_ARGS, "num_gpu_blocks_override": 24}  # 4 x (5..7 + 24) tokens in 24 blocks of 8: preempts


@pytest.fixture(scope="module")
def unsplit_texts(make_llm):
    llm = make_llm(**ENGINE)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


@pytest.mark.parametrize("devices_per_host, api_servers", [(1, 1), (2, 2)])
def test_two_hosts_serve_one_split_model(tmp_path, unsplit_texts, devices_per_host, api_servers):
    tp = 2 * devices_per_host  # every device of both hosts
    flags = cli_flags(tensor_parallel_size=tp, nnodes=2, master_port=free_port(), **ENGINE)
    env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices_per_host}"}
    worker_log = tmp_path / "worker.log"
    worker = subprocess.Popen([sys.executable, "-m", "jax_engine", "serve", "--headless", "--node-rank", "1", *flags],
                              stdout=open(worker_log, "w"), stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    try:
        driver, url = start_server_process("--node-rank", "0", "--api-server-count", str(api_servers), *flags,
                                           log_path=str(tmp_path / "driver.log"), env=env)
        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
            completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS, max_tokens=24,
                                                   temperature=0, extra_body={"ignore_eos": True})
            assert [c.text for c in sorted(completion.choices, key=lambda c: c.index)] == unsplit_texts
            # The driver's engine is a core process of its own, the one that joined the worker's JAX runtime.
            assert [cmdline for _, cmdline in child_processes(driver.pid) if CORE_MODULE in cmdline]
        finally:
            stop_server_process(driver)
        assert worker.wait(timeout=60) == 0, worker_log.read_text()[-3000:]  # released, not crashed
        assert f"{tp} devices in all, {devices_per_host} here" in worker_log.read_text()
    finally:
        worker.kill()


def test_workers_repeat_the_caller_of_every_device_program():
    """The driver broadcasts the calls of the runner methods that run device programs, a list read from the
    runner's program table (jax_engine/runner/device_programs.py): a program added there is repeated by the workers."""
    from jax_engine.runner.device_programs import DEVICE_PROGRAMS
    from jax_engine.runner.model_runner import ModelRunner

    assert ModelRunner.DEVICE_CALLS == {"execute", "sample", "greedy_tokens", "token_logprobs", "all_logits",
                                        "apply_block_moves"}
    assert all(callable(getattr(ModelRunner, program.caller)) for program in DEVICE_PROGRAMS)
    assert len({program.name for program in DEVICE_PROGRAMS}) == len(DEVICE_PROGRAMS)
