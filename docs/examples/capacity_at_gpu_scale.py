"""The paper's capacity arithmetic at GPU scale: the KV cache beside the weights."""

from simulator.cost_model import CostModel
from simulator.hardware import hardware
from simulator.model_spec import model_spec

SHAREGPT = 161 + 338  # a request's prompt + output tokens, on average (Fig. 11)
SERVED = [("opt-13b", "a100-40gb", 1), ("llama-3-8b", "a100-40gb", 1),
          ("llama-3-8b", "l4", 1), ("llama-3-70b", "h100-80gb", 8)]

print(f"{'model':<12}{'devices':<14}{'KV/token':>9}{'weights':>10}"
      f"{'KV cache':>10}{'tokens':>11}{'requests':>9}")
for model, device, tp in SERVED:
    cost = CostModel(hardware(device), model_spec(model), tensor_parallel_size=tp)
    # Per device: each holds 1/tp of the weights and of every token's KV heads.
    plan = cost.capacity
    kv_per_token = cost.kv_bytes_per_token * tp / 1024  # KiB, on all devices
    print(f"{model:<12}{f'{tp} x {device}':<14}{kv_per_token:5.0f} KiB"
          f"{cost.weight_bytes / 2**30:6.1f} GiB{plan.kv_cache_bytes / 2**30:6.1f} GiB"
          f"{plan.num_tokens:>11,}{plan.num_tokens // SHAREGPT:>9,}")
