"""Generate with the JAX engine: greedy text, then three seeded samples of a prompt."""

from jax_engine import LLM, SamplingParams

llm = LLM(max_model_len=1024)  # compiles every step shape first (see below)

greedy_params = SamplingParams(temperature=0, max_tokens=6)
[greedy] = llm.generate("The capital of France is", greedy_params, use_tqdm=False)
print(repr(greedy.outputs[0].text))

# n=3: the prompt is computed once, then forked into three sequences sharing its blocks.
sample_params = SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=8)
[samples] = llm.generate("My favourite food is", sample_params, use_tqdm=False)
for completion in samples.outputs:
    print(completion.index, repr(completion.text), completion.finish_reason)
print(llm.llm_engine.stats()["num_blocks"], "blocks")

assert len(samples.outputs) == 3
