"""Async scheduling: each step is planned while the one before runs; outputs stay."""

from jax_engine import LLM, SamplingParams

prompts = ["The capital of France is", "Count to ten: 1, 2,"]
params = [SamplingParams(temperature=0, max_tokens=12, stop=["."]),
          SamplingParams(temperature=0.8, seed=1, max_tokens=12)]
for async_scheduling in (False, True):
    llm = LLM(max_num_seqs=4, enforce_eager=True, async_scheduling=async_scheduling)
    trace = llm.llm_engine.enable_trace()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    print("async scheduling" if async_scheduling else "lockstep")
    for out in outputs:
        steps = [step.step for step in trace if out.request_id in dict(step.scheduled)]
        completion = out.outputs[0]
        print(f"  {completion.text!r:16} {completion.finish_reason:6} "
              f"ran in steps {steps[0]}-{steps[-1]}")
