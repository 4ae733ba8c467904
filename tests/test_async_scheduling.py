"""Async scheduling (jax_engine/async_scheduling.py) on the default model: each step is planned while the one before
it runs, and no output changes.

Two engines with the same arguments, one in lockstep and one planning ahead, take the same requests; every field
of every output must agree. The step trace shows the planning ahead: a sequence a stop string or EOS ends is
scheduled once more (its wasted row), which lockstep never does.
"""

import pytest

from jax_engine import EngineArgs, SamplingParams
from tests.server_helpers import TINY_ENGINE_ARGS, cli_flags, start_server_process, stop_server_process
from tests.test_memory_management import assert_no_leak

ARGS = dict(num_gpu_blocks_override=48, block_size=16, max_model_len=160, max_num_seqs=8, max_num_batched_tokens=64)
PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):", "List three colours:",
           "Write a haiku about rain.", "Hello! How are you today?", "1, 2, 3, 4,", "The best way to learn is"]
# Every way a sequence ends, and the sampler's state that reads its earlier tokens (penalties, logprobs).
PARAMS = [SamplingParams(temperature=0, max_tokens=40, stop=["."]),
          SamplingParams(temperature=0.9, seed=7, max_tokens=30, logprobs=2, presence_penalty=0.5),
          SamplingParams(temperature=0, max_tokens=1),
          SamplingParams(temperature=1.0, max_tokens=25, repetition_penalty=1.3, frequency_penalty=0.2),
          SamplingParams(temperature=0.7, seed=1, max_tokens=60, min_tokens=12, stop=["\n"]),
          SamplingParams(temperature=0, max_tokens=50),
          SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[11], include_stop_str_in_output=True),
          SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=35, ignore_eos=True, stop=[" the"])]


def fields(outputs) -> list:
    """Everything a request's output says, comparable."""
    return [(o.request_id, o.finished, [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob,
                                          c.logprobs) for c in o.outputs]) for o in outputs]


@pytest.fixture(scope="module")
def engines(make_llm):
    return make_llm(**ARGS), make_llm(**ARGS, async_scheduling=True)


def test_outputs_equal_lockstep_and_the_next_step_is_planned_ahead(engines):
    lockstep, ahead = engines
    traces = [llm.llm_engine.enable_trace() for llm in engines]
    expected, got = (llm.generate(PROMPTS, PARAMS, use_tqdm=False) for llm in engines)
    assert fields(got) == fields(expected)
    for llm in engines:
        assert_no_leak(llm)

    def steps_run(trace, seq_id):
        return sum(seq_id in dict(step.scheduled) for step in trace)

    for output, params in zip(expected, PARAMS):
        finish = output.outputs[0].finish_reason, output.outputs[0].stop_reason
        extra = steps_run(traces[1], output.request_id) - steps_run(traces[0], output.request_id)
        # A sequence whose next token reaches max_tokens gets no stand-in; one ended before that ran a step ahead.
        ended_early = len(output.outputs[0].token_ids) < params.max_tokens
        assert extra == ended_early, (output.request_id, finish)
    assert {o.outputs[0].finish_reason for o in expected} == {"stop", "length"}
    lockstep.llm_engine.trace = ahead.llm_engine.trace = None


def test_aborts_while_a_step_is_in_flight_free_every_block(engines):
    """An abort between steps finds the aborted request's next step already running: its token is dropped."""
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=30, ignore_eos=True) for i in range(8)]
    results = []
    for llm in engines:
        engine, outputs = llm.llm_engine, {}
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"abort-{i}", prompt, params[i])
        for step in range(40):
            if step == 6:
                engine.abort_request(["abort-0", "abort-5"])
            if step == 9:
                engine.abort_request("abort-7")
            outputs.update((out.request_id, out) for out in engine.step())
            if not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests()
        assert_no_leak(llm)
        results.append({rid: (out.outputs[0].finish_reason, out.outputs[0].token_ids) for rid, out in outputs.items()})
    lockstep, ahead = results
    for rid in ("abort-0", "abort-5", "abort-7"):
        assert ahead[rid][0] == lockstep[rid][0] == "abort"
    assert {rid: out for rid, out in ahead.items() if out[0] != "abort"} == \
        {rid: out for rid, out in lockstep.items() if out[0] != "abort"}


def test_requests_that_need_lockstep_switch_the_engine_to_it_and_back(engines):
    """Parallel samples, beam search and prompt logprobs need each token before the next step is planned: while
    one is unfinished the engine steps in lockstep (finishing the step in flight first), then plans ahead again."""
    from jax_engine import BeamSearchParams

    needs_lockstep = [("n2", SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=8)),
                      ("beams", BeamSearchParams(beam_width=2, max_tokens=6)),
                      ("prompt-logprobs", SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=1))]
    results = []
    for llm in engines:
        engine, outputs, in_flight = llm.llm_engine, {}, []
        for i, prompt in enumerate(PROMPTS[:3]):  # long enough to run through all three
            engine.add_request(f"plain-{i}", prompt, SamplingParams(temperature=i / 2, seed=i, max_tokens=70,
                                                                    ignore_eos=True))
        for step in range(200):
            if step in (3, 20, 40):
                rid, params = needs_lockstep[(3, 20, 40).index(step)]
                engine.add_request(rid, "Tell me about the sea.", params)
            outputs.update((out.request_id, out) for out in engine.step())
            in_flight.append(engine._in_flight is not None)
            if not engine.has_unfinished_requests():
                break
        assert_no_leak(llm)
        results.append(fields(sorted(outputs.values(), key=lambda out: out.request_id)))
        if llm is engines[1]:
            assert in_flight[:3] == [True] * 3 and not in_flight[3]  # the beam search came: lockstep
            assert in_flight[-1] is False and True in in_flight[21:]  # and back to planning ahead in between
    assert results[1] == results[0]


@pytest.mark.parametrize("other", [dict(nnodes=2), dict(task="embed"),
                                   dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2})])
def test_async_scheduling_refuses_what_it_cannot_plan_ahead_of(other):
    with pytest.raises(ValueError, match="async_scheduling must be False with nnodes > 1, a speculative_config or "
                                         "task 'embed', got True"):
        EngineArgs(async_scheduling=True, **other)


def test_serve_with_async_scheduling_answers_as_the_engine_does(tiny_checkpoint_dir, tmp_path):
    """`jax-engine serve --async-scheduling` (an engine core in its own process) through the official client."""
    import openai

    from jax_engine import LLM

    log = tmp_path / "server.log"
    process, url = start_server_process(tiny_checkpoint_dir, *cli_flags(**TINY_ENGINE_ARGS), "--async-scheduling",
                                        "--served-model-name", "tiny", log_path=str(log))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        prompts = [f"{i} little pigs went" for i in range(6)]
        texts = [client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.8, seed=i,
                                           stop=["ab"]).choices[0].text for i, prompt in enumerate(prompts)]
        stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=12, stream=True, temperature=0)
        streamed = "".join(chunk.choices[0].text for chunk in stream)
    finally:
        stop_server_process(process)
    assert process.returncode == 0 and "Traceback" not in log.read_text()
    assert "async scheduling)" in log.read_text()  # the engine core's start-up line
    llm = LLM(tiny_checkpoint_dir, **TINY_ENGINE_ARGS)
    expected = llm.generate(prompts, [SamplingParams(max_tokens=12, temperature=0.8, seed=i, stop=["ab"])
                                      for i in range(6)], use_tqdm=False)
    assert texts == [out.outputs[0].text for out in expected]
    assert streamed == llm.generate(prompts[0], SamplingParams(max_tokens=12, temperature=0),
                                    use_tqdm=False)[0].outputs[0].text
