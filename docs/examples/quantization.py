"""Weight-only quantization: bf16, int8 or the GGUF file's own blocks; float32 sums."""

import jax
from flax import nnx

from jax_engine import LLM, SamplingParams

params = SamplingParams(temperature=0, max_tokens=10)
for quantization in (None, "bf16", "int8", "gguf"):
    llm = LLM(max_model_len=256, max_num_seqs=4, quantization=quantization,
              enforce_eager=True)  # one request: compile on first use
    model = llm.llm_engine.runner.model
    megabytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model))) / 1e6
    [output] = llm.generate("The capital of France is", params, use_tqdm=False)
    text = output.outputs[0].text
    print(f"{quantization or 'float32':>7}: {megabytes:5.0f} MB {text!r}")
