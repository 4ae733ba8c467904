"""A draft model: the default model drafts for itself with int8 weights."""

import textwrap

from jax_engine import LLM, SamplingParams

messages = [{"role": "user", "content": "Why is the sky blue? Two sentences."}]
params = SamplingParams(temperature=0, max_tokens=48)

# enforce_eager: compile the shapes this request meets, not every batch size.
plain = LLM(max_model_len=512, enforce_eager=True)
drafting = LLM(max_model_len=512, enforce_eager=True, speculative_config={
    "model": "self", "quantization": "int8", "num_speculative_tokens": 3})
[ours] = plain.chat(messages, params, use_tqdm=False)
[theirs] = drafting.chat(messages, params, use_tqdm=False)
# The float32 target verifies every draft: the tokens are its own.
assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids

print(textwrap.fill(theirs.outputs[0].text, 80))
print(len(theirs.outputs[0].token_ids), "tokens in", drafting.llm_engine.num_steps,
      "steps with drafts,", plain.llm_engine.num_steps, "without")
spec = drafting.llm_engine.stats()["spec_decode"]
print(f"drafted {spec['num_draft_tokens']}, accepted {spec['num_accepted_tokens']}: "
      f"{spec['mean_acceptance_length']:.2f} tokens a step")
