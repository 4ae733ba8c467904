"""Answers to page 7's exercises, computed by the reference engine itself."""

from reference import ReferenceEngine, SamplingParams, SchedulerConfig
from reference.tutorial.tiny_llama import tiny_llama

model = tiny_llama()
greedy = SamplingParams(temperature=0, max_tokens=4)


def new_engine(budget: int) -> ReferenceEngine:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                             max_model_len=32, enable_chunked_prefill=True)
    engine = ReferenceEngine(model, num_blocks=8, block_size=4, scheduler_config=config)
    engine.add_request("a", [5, 9, 2, 7, 1, 3], greedy)
    engine.add_request("b", [4, 4, 8, 6, 2], greedy)
    return engine


# 1. The example's two requests under a budget of 4 tokens instead of 8: what does each
#    of the first four steps compute, and when does each request get its first token?
engine = new_engine(budget=4)
for step in range(4):
    engine.step()
    computed = [(s.request_id, s.num_new_tokens) for s in engine.trace[-1].scheduled]
    requests = engine.scheduler.requests
    outputs = {rid: len(r.output_token_ids) for rid, r in requests.items()}
    print(f"1. step {step} computes {computed}; tokens out {outputs}")

# 2. In that run's step 1, where do the new tokens' keys and values go?
engine = new_engine(budget=4)
engine.step()
out = engine.scheduler.schedule()
md = engine._prepare_batch(out).metadata
print(f"2. step 1: tables {[s.block_table for s in out.scheduled]}, "
      f"slot_mapping {md.slot_mapping.tolist()}")

# 3. Run a and b to the end (budget 8), then send c with a's prompt.
#    How many of c's tokens are found in the prefix cache, and what does its first
#    step compute?
engine = new_engine(budget=8)
while engine.has_unfinished_requests():
    engine.step()
engine.add_request("c", [5, 9, 2, 7, 1, 3], greedy)
engine.step()
c, out = engine.scheduler.requests["c"], engine.trace[-1]
print(f"3. c finds {c.num_cached_tokens} tokens cached; its first step computes "
      f"{out.scheduled[0].num_new_tokens}, table {out.scheduled[0].block_table}")
