"""Prompt-lookup drafts: the default model repeats a passage, with and without them."""

import textwrap

from jax_engine import LLM, SamplingParams

passage = ("The train to the coast leaves from platform four every hour, on the "
           "hour. The journey takes two hours and passes through three small towns "
           "and a long valley of orchards.")
messages = [{"role": "user", "content": f"Repeat this passage:\n\n{passage}"}]
params = SamplingParams(temperature=0, max_tokens=64)

# enforce_eager: compile the shapes this request meets, not every batch size.
plain = LLM(max_model_len=512, enforce_eager=True)
drafting = LLM(max_model_len=512, enforce_eager=True, speculative_config={
    "method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_min": 2, "prompt_lookup_max": 5})
[ours] = plain.chat(messages, params, use_tqdm=False)
[theirs] = drafting.chat(messages, params, use_tqdm=False)
# Drafts change no token.
assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids

print(textwrap.fill(theirs.outputs[0].text, 80))
print(len(theirs.outputs[0].token_ids), "tokens in", drafting.llm_engine.num_steps,
      "steps with drafts,", plain.llm_engine.num_steps, "without")
spec = drafting.llm_engine.stats()["spec_decode"]
print(f"drafted {spec['num_draft_tokens']}, accepted {spec['num_accepted_tokens']}: "
      f"{spec['mean_acceptance_length']:.2f} tokens a step")
