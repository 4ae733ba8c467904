"""One ReferenceEngine step, stage by stage, on a tiny random Llama (NumPy only)."""

import numpy as np

from reference import ReferenceEngine, SamplingParams, SchedulerConfig, sample
from reference.tutorial.tiny_llama import tiny_llama  # 2 layers, 4 heads, 32 tokens


def new_engine() -> ReferenceEngine:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32,
                             enable_chunked_prefill=True)
    engine = ReferenceEngine(tiny_llama(), num_blocks=8, block_size=4,
                             scheduler_config=config)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    engine.add_request("a", [5, 9, 2, 7, 1, 3], greedy)
    engine.add_request("b", [4, 4, 8, 6, 2], greedy)
    return engine


engine = new_engine()
engine.step()  # step 0: a's 6 prompt tokens and 2 of b's 5, under a budget of 8
requests = engine.scheduler.requests
# Step 1 by hand, exactly as ReferenceEngine.step does it:
out = engine.scheduler.schedule()  # 1. who runs, how many tokens, which blocks
print("1 schedule:", [(s.request_id, s.num_new_tokens, s.block_table)
                      for s in out.scheduled])
engine.kv_cache.swap_out(out.swap_out)  # 2. the block copies this step relies on
engine.kv_cache.swap_in(out.swap_in)
engine.kv_cache.copy_blocks(out.copies)
print("2 copies:   swap_out", out.swap_out, " swap_in", out.swap_in,
      " copies", out.copies)
batch = engine._prepare_batch(out)  # 3. one flat batch of every request's new tokens
md = batch.metadata
print("3 batch:    token_ids", batch.token_ids.tolist(),
      " positions", batch.positions.tolist())
print("            slot_mapping", md.slot_mapping.tolist(), " query_start_loc",
      md.query_start_loc.tolist(), " seq_lens", md.seq_lens.tolist())
print("            block_tables", md.block_tables,
      " logits_indices", batch.logits_indices.tolist(), "for", batch.sampling_ids)
# 4. the model writes each new token's K/V at its slot, attends through the tables
logits = engine.model.forward(batch.token_ids, batch.positions, engine.kv_cache, md,
                              batch.logits_indices)
print("4 model:    logits", logits.shape)
sampled = {rid: sample(row, requests[rid].sampling_params, requests[rid].num_tokens,
                       engine.rng, requests[rid].output_token_ids)
           for rid, row in zip(batch.sampling_ids, logits)}  # 5. a token per request
print("5 sample:  ", sampled)
engine.scheduler.update_from_output(out, sampled, engine.eos_token_ids)  # 6. append
print("6 update:  ", {rid: r.output_token_ids for rid, r in requests.items()})

twin = new_engine()  # the same two steps, through ReferenceEngine.step itself
twin.step()
twin.step()
assert all(twin.scheduler.requests[rid].token_ids == requests[rid].token_ids
           for rid in requests)

while engine.has_unfinished_requests():
    engine.step()
for rid, request in requests.items():
    # Each token again from scratch: the whole sequence as one prefill, no paging.
    tokens = list(request.prompt_token_ids)
    for _ in range(4):
        tokens.append(int(np.argmax(engine.model.last_logits(tokens))))
    from_scratch = tokens[len(request.prompt_token_ids):]
    print(f"{rid}: {request.output_token_ids} {request.status.name}, "
          f"from scratch {from_scratch}")
    assert request.output_token_ids == from_scratch
