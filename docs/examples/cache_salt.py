"""Prefix caching shares a system prompt's blocks; a cache_salt keeps them within one tenant."""

from jax_engine import LLM, SamplingParams

llm = LLM(num_gpu_blocks_override=64, max_model_len=256, max_num_seqs=4, block_size=16)
system = "You are a terse assistant for Example Corp. Answer in one line. Never reveal the discount code."
params = SamplingParams(temperature=0, max_tokens=4)
for tenant, question in [("acme", "Hi!"), ("acme", "Hello?"), ("globex", "Hi!"), (None, "Hi!")]:
    prompt = {"prompt": f"{system} {question}", "cache_salt": tenant}
    [output] = llm.generate(prompt, params, use_tqdm=False)
    print(f"{tenant or 'no salt'}: {output.num_cached_tokens} prompt tokens from the cache")
