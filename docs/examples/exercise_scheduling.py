"""Answers to page 6's exercises, computed by the reference Scheduler itself."""

from reference import BlockManager, Request, SamplingParams, Scheduler, SchedulerConfig

# (id, prompt length, max_tokens); a, b and c arrive at step 0, d at step 3
REQUESTS = [("a", 7, 6), ("b", 6, 6), ("c", 5, 4)]


def run(mode: str) -> list[tuple]:
    """One record per step: (tokens per request, free blocks after scheduling,
    preempted, swap_out, swap_in)."""
    bm = BlockManager(num_blocks=7, block_size=4, num_host_blocks=8,
                      enable_prefix_caching=False)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                             max_model_len=16, preemption_mode=mode)
    scheduler = Scheduler(config, bm)
    for arrival, (rid, n, max_tokens) in enumerate(REQUESTS):
        params = SamplingParams(max_tokens=max_tokens)
        scheduler.add_request(Request(rid, list(range(n)), params, arrival=arrival))
    steps = []
    while scheduler.has_unfinished_requests():
        if len(steps) == 3:
            scheduler.add_request(Request("d", [1, 2], SamplingParams(max_tokens=2),
                                          arrival=3))
        out = scheduler.schedule()
        tokens = {s.request_id: s.num_new_tokens for s in out.scheduled}
        steps.append((tokens, bm.device.num_free_blocks, out.preempted, out.swap_out,
                      out.swap_in))
        scheduler.update_from_output(out, {rid: 7 for rid in tokens})
    return steps


for mode in ("recompute", "swap"):
    print(f"{mode}:")
    for step, (tokens, free, preempted, swap_out, swap_in) in enumerate(run(mode)):
        line = f"  step {step}: {str(tokens):<25} free {free}"
        line += f"  preempted {preempted}" if preempted else ""
        line += f"  swap_out {swap_out}" if swap_out else ""
        line += f"  swap_in {swap_in}" if swap_in else ""
        print(line)

steps = run("recompute")
first = next(step for step, record in enumerate(steps) if record[2])
d_starts = next(step for step, record in enumerate(steps) if "d" in record[0])
c_done = max(step for step, record in enumerate(steps) if "c" in record[0])
print(f"1. {steps[first][2]} preempted at step {first}")
print(f"2. d starts at step {d_starts}, with c; under the paper's rule, at step "
      f"{c_done + 1} (once c completes)")
back = {mode: run(mode)[d_starts][0]["c"] for mode in ("recompute", "swap")}
print(f"3. back at step {d_starts}, c computes {back['recompute']} tokens by "
      f"recompute, {back['swap']} by swap")
