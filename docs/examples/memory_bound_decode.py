"""One token per step, and every step reads all the weights and the whole KV cache."""

from jax_engine.loader import load_checkpoint
from reference import LlamaModel, ReferenceEngine, SamplingParams

checkpoint = load_checkpoint()  # the default model, SmolLM2-135M-Instruct
cfg, tokenizer = checkpoint.config, checkpoint.tokenizer
num_blocks, block_size = 4, 16
engine = ReferenceEngine(LlamaModel(cfg, checkpoint.weights), num_blocks=num_blocks,
                         block_size=block_size, tokenizer=tokenizer)
params = SamplingParams(temperature=0, max_tokens=3)
[generation] = engine.generate(["The capital of France is"], params)

context = 0
for step, (out, token) in enumerate(zip(engine.trace, generation.output_token_ids), 1):
    [scheduled] = out.scheduled  # one request: what this step computes for it
    context += scheduled.num_new_tokens
    print(f"step {step}: computes {scheduled.num_new_tokens} token(s), attends over "
          f"{context} tokens, samples {tokenizer.decode([token])!r}")

# The KV cache: a key and a value vector per layer and KV head, for every token.
kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32
cache = engine.kv_cache
assert cache.k.nbytes + cache.v.nbytes == num_blocks * block_size * kv_bytes_per_token
weight_bytes = sum(w.nbytes for w in checkpoint.weights.values())
print(f"KV cache per token: 2 x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads"
      f" x {cfg.head_dim} dims x 4 bytes = {kv_bytes_per_token:,} bytes")
print(f"weights: {cfg.num_params:,} parameters = {weight_bytes / 1e6:.0f} MB; "
      f"a 2048-token context: {2048 * kv_bytes_per_token / 1e6:.0f} MB of K/V")

# One decode step at batch B (every sequence at the same context): the weights are read
# once for the whole batch, but every sequence reads its own K/V.
context = 512
attention_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context  # qk, pv
flops_per_token = 2 * cfg.num_params + attention_flops
print(f"one decode step, context {context}:")
print("batch  weights read  K/V read  GFLOP  FLOP per byte")
for batch in (1, 8, 64, 256):
    kv_bytes = batch * context * kv_bytes_per_token
    intensity = batch * flops_per_token / (weight_bytes + kv_bytes)
    print(f"{batch:>5}  {weight_bytes / 1e6:>9.0f} MB  {kv_bytes / 1e6:>5.0f} MB  "
          f"{batch * flops_per_token / 1e9:>5.1f}  {intensity:>13.1f}")
limit = flops_per_token / (context * kv_bytes_per_token)
print(f"as the batch grows, FLOP per byte tends to {limit:.1f}: K/V reads take over")
full_batch = 256 * 2048 * kv_bytes_per_token
print(f"256 sequences of 2048 tokens hold {full_batch / 1e9:.1f} GB of K/V")
assert weight_bytes == 4 * cfg.num_params and "Paris" in generation.text
