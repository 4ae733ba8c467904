"""Answers to page 11's exercises, computed by the oracle's own functions."""

import numpy as np

from reference import BlockManager, Request, SamplingParams, Scheduler, SchedulerConfig
from reference.speculative import (acceptance_probability, propose_ngram,
                                   residual_distribution)


def show(probs: np.ndarray) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in probs) + "]"


# 1. Prompt lookup with k = 3, n from 3 down to 1: what is drafted after this context?
context = [7, 1, 2, 3, 9, 1, 2, 3, 5, 1, 2]
print("1. drafts:", propose_ngram(context, 3, prompt_lookup_min=1, prompt_lookup_max=3))

# 2. The target's p and the draft's q on three tokens; the draft proposed token 2.
p, q, x = np.array([0.6, 0.3, 0.1]), np.array([0.2, 0.2, 0.6]), 2
print(f"2. accepted with probability {acceptance_probability(p[x], q[x]):.3f}; "
      f"a rejection draws from {show(residual_distribution(p, q))}")
#    A careless verifier redraws from p after a rejection. What does it emit?
accept = np.array([acceptance_probability(p[y], q[y]) for y in range(3)])
reject = 1 - (q * accept).sum()  # the chance that the proposed draft is rejected
print(f"   redrawing from p emits {show(q * accept + reject * p)}, not p = {show(p)}")

# 3. Blocks of 4 tokens. A 6-token prompt is prefilled and samples token 7; the proposer
#    then drafts 5 tokens. Which blocks does the next step write, and which remain
#    after the target accepts the first draft only (emitting 9 in place of the second)?
bm = BlockManager(num_blocks=8, block_size=4)
scheduler = Scheduler(SchedulerConfig(), bm)
prompt = [11, 12, 13, 14, 15, 16]
scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=10), arrival=0))
scheduler.update_from_output(scheduler.schedule(), {"a": 7})  # the prefill
request = scheduler.requests["a"]
request.spec_token_ids = [1, 2, 3, 4, 5]
out = scheduler.schedule()
[s] = out.scheduled
print(f"3. the step computes {s.num_new_tokens} tokens into blocks {s.block_table}")
scheduler.update_from_output(out, {"a": [1, 9]})
print(f"   after: table {bm.block_table('a')}, {request.num_computed_tokens} computed, "
      f"cached {sorted(bm.device.cached_blocks.values())}, "
      f"free queue {list(bm.device.free_queue)}")
