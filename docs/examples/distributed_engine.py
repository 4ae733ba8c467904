"""SmolLM2 split over 1 to 4 CPU devices: what device 0 holds; the greedy text."""

import os

# XLA splits the host CPU into devices only before JAX starts (GPUs are devices as is).
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

from jax_engine import LLM, SamplingParams  # noqa: E402

greedy = SamplingParams(temperature=0, max_tokens=12)
print("tp  q/k/v rows  o cols  KV heads  KV cache on device 0   layout of q heads")
texts = []
for tp in (1, 2, 3, 4):
    llm = LLM(tensor_parallel_size=tp, max_model_len=128, num_gpu_blocks_override=16,
              block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
              enforce_eager=True)
    runner = llm.llm_engine.runner
    model = runner.model
    w_qkv = model.layers["w_qkv"][...].addressable_shards[0].data  # [L, rows, H]
    w_o = model.layers["w_o"][...].addressable_shards[0].data  # [L, H, cols]
    cache = runner.k_cache.addressable_shards[0].data  # [L, blocks, block size, K, D]
    heads = "all 9" if model.parallel is None else " | ".join(
        ",".join("-" if h < 0 else str(h) for h in q) for q in model.parallel.heads.q)
    print(f"{tp:<4}{w_qkv.shape[1]:<12}{w_o.shape[2]:<8}{cache.shape[3]:<10}"
          f"{str(cache.shape):<22}{heads}")
    texts.append(llm.generate("The capital of France is", greedy, use_tqdm=False)[0]
                 .outputs[0].text)
print("greedy text:", repr(texts[0]))
print("the same for every tp:", len(set(texts)) == 1)
