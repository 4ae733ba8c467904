"""vLLM's scheduling_policy through LLM and the server: "priority" serves requests in order of the priority each is
given."""

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from jax_engine import LLM, SamplingParams
from tests.server_helpers import (TINY_ENGINE_ARGS, cli_flags, metric, start_server_process, stop_server_process,
                                  wait_for)

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
LARGEST = 2**63 - 1  # the request field's bound (protocol.Priority)
PROMPTS = [[256, 5, 6], [256, 7, 8], [256, 9, 10], [256, 11, 12]]


def tiny_llm(directory: str, **kwargs) -> LLM:
    return LLM(directory, max_num_seqs=1, num_gpu_blocks_override=16, block_size=8, max_model_len=64,
               enforce_eager=True, **kwargs)


def test_priority_policy_runs_the_lowest_priority_first(tiny_checkpoint_dir):
    """One request at a time (max_num_seqs=1): they run in order of priority, whatever order they came in, and a
    tie goes to the earlier arrival."""
    llm = tiny_llm(tiny_checkpoint_dir, scheduling_policy="priority")
    trace = llm.llm_engine.enable_trace()
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[2, -1, 2, 0])
    started = list(dict.fromkeys(seq_id for step in trace for seq_id, _ in step.scheduled))
    assert started == [outputs[i].request_id for i in (1, 3, 0, 2)]
    assert all(len(o.outputs[0].token_ids) == 2 for o in outputs)


def test_a_priority_needs_the_priority_policy(tiny_checkpoint_dir):
    """The default "fcfs" refuses a priority other than 0, naming it, and queues none of the prompts; FCFS order
    is kept."""
    llm = tiny_llm(tiny_checkpoint_dir)
    with pytest.raises(ValueError, match="priority must be 0 unless scheduling_policy is 'priority'"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=[0, 1])
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="got 1 priority for 2 prompts"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        tiny_llm(tiny_checkpoint_dir, scheduling_policy="lifo")
    trace = llm.llm_engine.enable_trace()
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[0] * 4)
    assert list(dict.fromkeys(seq_id for step in trace for seq_id, _ in step.scheduled)) == [o.request_id for o in
                                                                                                outputs]


def test_a_priority_server_lets_the_lowest_priority_in_first(long_checkpoint_dir, tmp_path):
    """`jax-engine serve --scheduling-policy priority`, one request at a time: while a long answer runs, a request
    of the largest priority and then one of the smallest (a signed 64-bit int's ends) wait; the second runs first,
    and the one running meanwhile is undisturbed. Through the official openai client and
    the engine core process (the priority crosses to it with the request)."""
    flags = cli_flags(**{**TINY_ENGINE_ARGS, "max_num_seqs": 1, "max_model_len": 512, "max_num_batched_tokens": 512})
    process, url = start_server_process(long_checkpoint_dir, *flags, "--scheduling-policy", "priority",
                                        log_path=str(tmp_path / "server.log"))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        long = client.completions.create(model=long_checkpoint_dir, prompt="Hi", max_tokens=400, stream=True,
                                         extra_body={"min_tokens": 400, "ignore_eos": True})
        next(iter(long))  # it runs, and holds the one seat
        finished = []

        def ask(priority: int) -> None:
            client.completions.create(model=long_checkpoint_dir, prompt="Hello", max_tokens=4,
                                      extra_body={"priority": priority})
            finished.append(priority)

        with ThreadPoolExecutor(2) as pool:
            for waiting, priority in enumerate((LARGEST, -LARGEST - 1), start=1):
                pool.submit(ask, priority)
                wait_for(lambda n=waiting: metric(url, "vllm:num_requests_waiting") >= n, 30, f"{waiting} waiting")
            assert sum(1 for _ in long) > 0  # the long answer ends only now, after both came
        assert finished == [-LARGEST - 1, LARGEST]
    finally:
        stop_server_process(process)
