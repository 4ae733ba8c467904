"""Two LoRA adapters and the base model in one batch of the default model: each row
equals its request run alone, and one step's tokens carry their adapters' slots."""

import tempfile

from jax_engine import LLM, LoRARequest, SamplingParams
from jax_engine.lora.random_adapter import write_random_adapter

llm = LLM(enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=256,
          enforce_eager=True)
runner = llm.llm_engine.runner
adapters = tempfile.mkdtemp()
for i in (1, 2):  # random rank-8 adapters on every projection, in PEFT's format
    write_random_adapter(f"{adapters}/a{i}", runner.lora.layout, 8, seed=i, b_scale=0.1)
chosen = [None, LoRARequest("a1", 1, f"{adapters}/a1"),
          LoRARequest("a2", 2, f"{adapters}/a2")]
prompt = "The three primary colors are"
params = SamplingParams(temperature=0, max_tokens=8)

steps = []  # the token -> slot array of every step
prepare = runner.prepare
runner.prepare = lambda out: steps.append(prepare(out)) or steps[-1]
together = llm.generate([prompt] * 3, params, lora_request=chosen, use_tqdm=False)
alone = [llm.generate(prompt, params, lora_request=c, use_tqdm=False)[0]
         for c in chosen]
for request, mixed, single in zip(chosen, together, alone):
    name = "base" if request is None else request.lora_name
    same = mixed.outputs[0].token_ids == single.outputs[0].token_ids
    print(f"{name:>4}: {mixed.outputs[0].text!r}  same alone: {same}")
print("step 1, slot of each token:", steps[0].lora_slots.tolist())
print("step 2, slot of each token:", steps[1].lora_slots.tolist())
print("slots hold adapters", runner.lora.slots)
