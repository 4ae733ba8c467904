"""Where KV-cache memory goes under load: contiguous reservations versus paging."""

from jax_engine.bench.workloads import request_lengths
from reference.tutorial.kv_memory import (contiguous_usage_under_load,
                                          paged_usage_under_load)

# 400 requests with ShareGPT-like lengths (means 161 prompt, 338 output tokens), all
# waiting at once, served from one KV cache of 40,000 token slots.
prompts, outputs, _ = request_lengths(400, "sharegpt-like", max_model_len=2048, seed=0)
trace = list(zip(prompts.tolist(), outputs.tolist()))
arena, max_model_len, block_size = 40_000, 2048, 16
lengths = [p + o for p, o in trace]
# The paper's Pow2: the prompt, plus the output rounded up to a power of two (<= 2x).
pow2 = [p + (1 << (o - 1).bit_length()) for p, o in trace]

systems = {
    "contiguous, max_model_len": contiguous_usage_under_load(
        trace, [max_model_len] * len(trace), arena),
    "contiguous, pow2 output": contiguous_usage_under_load(trace, pow2, arena),
    "contiguous, exact (oracle)": contiguous_usage_under_load(trace, lengths, arena),
    f"paged, {block_size}-token blocks": paged_usage_under_load(
        trace, block_size, arena // block_size, max_model_len),
}
print(f"{'reservation':<28}{'used':>7}{'reserved':>10}{'internal':>10}{'external':>10}")
for name, u in systems.items():
    internal, external = u.internal_fragmentation, u.external_fragmentation
    print(f"{name:<28}{u.used / u.total:>7.1%}{u.reserved / u.total:>10.1%}"
          f"{internal / u.total:>10.1%}{external / u.total:>10.1%}")

*contiguous, paged = systems.values()
assert max(u.utilization for u in contiguous) < 0.6 < 0.95 < paged.utilization
