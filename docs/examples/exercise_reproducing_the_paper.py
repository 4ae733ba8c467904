"""Answers to page 10's exercises, from the reference's accounting and scheduler."""

from reference import BlockManager, Request, SamplingParams
from reference.scheduler import Scheduler, SchedulerConfig
from reference.tutorial.kv_memory import contiguous_usage, paged_usage

trace = [(10, 20), (30, 5), (4, 40)]  # (prompt, output) tokens of three requests

# 1. Figure 2's accounting: what fraction of the slots these requests hold holds
#    tokens, reserving 64 slots each, or paging in blocks of 16?
print(f"1. contiguous (64 slots): {contiguous_usage(trace, 64).utilization:.1%}; "
      f"paged (16): {paged_usage(trace, 16).utilization:.1%}")

# 2. And paged, at block sizes 1, 16 and 128?
print("2.", ", ".join(f"block {b}: {paged_usage(trace, b).utilization:.1%}"
                      for b in (1, 16, 128)))


# 3. Figure 19's two modes: four requests of 8 prompt tokens and 8 new ones each,
#    a cache of 8 blocks of 4 tokens, no prefix caching (the paper had none).
#    What does each mode pay for its preemptions?
def run(mode: str) -> str:
    bm = BlockManager(8, block_size=4, num_host_blocks=16, enable_prefix_caching=False)
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=16,
                             preemption_mode=mode)
    scheduler = Scheduler(config, bm)
    for i in range(4):
        scheduler.add_request(Request(f"r{i}", list(range(8)),
                                      SamplingParams(max_tokens=8), arrival=i))
    computed = swapped = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        computed += out.num_batched_tokens
        swapped += len(out.swap_out)
        scheduler.update_from_output(out, {s.request_id: 1 for s in out.scheduled})
    again = computed - 4 * (8 + 7)  # each computes its prompt and 7 of its 8 tokens
    return (f"{mode}: {scheduler.num_preemptions} preempted, "
            f"{again} tokens computed again, {swapped} blocks swapped out")


print("3.", run("recompute"))
print("3.", run("swap"))
