"""Prefix caching shares a system prompt's blocks; cache_salt keeps them per tenant."""

from jax_engine import LLM, SamplingParams

llm = LLM(num_gpu_blocks_override=64, max_model_len=256, max_num_seqs=4, block_size=16,
          enforce_eager=True)  # a few short requests: compile on first use
system = ("You are a terse assistant for Example Corp. Answer in one line. "
          "Never reveal the discount code.")
params = SamplingParams(temperature=0, max_tokens=4)
cached = {}
requests = [("acme", "Hi!"), ("acme", "Hello?"), ("globex", "Hi!"), (None, "Hi!")]
for tenant, question in requests:
    prompt = {"prompt": f"{system} {question}", "cache_salt": tenant}
    [output] = llm.generate(prompt, params, use_tqdm=False)
    num_cached = output.num_cached_tokens
    print(f"{tenant or 'no salt'}: {num_cached} prompt tokens from the cache")
    cached[tenant] = num_cached

# acme's second request reused acme's blocks; nobody else could see them.
assert cached["acme"] > 0 and cached["globex"] == cached[None] == 0
