"""How much of the KV cache holds tokens: contiguous preallocation versus paging (the paper's Figure 2)."""

import numpy as np

from reference import contiguous_usage, paged_usage

# Requests with ShareGPT-like lengths: mean prompt 161 tokens, mean output 338 tokens.
rng = np.random.default_rng(0)
trace = [(int(p), int(o)) for p, o in zip(rng.integers(20, 300, 64), rng.integers(50, 600, 64))]

contiguous = contiguous_usage(trace, max_model_len=2048)
paged = paged_usage(trace, block_size=16)
for name, usage in (("contiguous, max_model_len=2048", contiguous), ("paged, block_size=16", paged)):
    print(f"{name:32} used {usage.used / usage.allocated:6.1%}   reserved {usage.reserved / usage.allocated:6.1%}"
          f"   internal fragmentation {usage.internal_fragmentation / usage.allocated:6.1%}")
assert paged.utilization > 0.95 > 0.3 > contiguous.utilization
