"""Generate with the JAX engine: greedy text, then three seeded samples of one prompt."""

from jax_engine import LLM, SamplingParams

llm = LLM(num_gpu_blocks_override=64, max_model_len=256, max_num_seqs=4)
[greedy] = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
print(repr(greedy.outputs[0].text))
[samples] = llm.generate("My favourite food is", SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=8),
                         use_tqdm=False)
for completion in samples.outputs:
    print(completion.index, repr(completion.text), completion.finish_reason)
print(llm.llm_engine.stats()["num_blocks"], "blocks")
