"""The same requests under both scheduling policies: "fcfs" and vLLM's "priority"."""

from reference import BlockManager, Request, SamplingParams, Scheduler, SchedulerConfig

# step -> the requests arriving then: (id, prompt length, max_tokens, priority)
ARRIVALS = {0: [("r0", 6, 8, 1)], 1: [("r1", 5, 8, 1), ("r2", 7, 6, 0)],
            2: [("r3", 4, 6, -1)]}


def run(policy: str) -> tuple[list[str], list[str]]:
    """The order requests start running in, and each preemption (who, at which step)."""
    bm = BlockManager(num_blocks=5, block_size=4, num_host_blocks=0,
                      enable_prefix_caching=False)
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16,
                             max_model_len=24, enable_chunked_prefill=True,
                             policy=policy)
    scheduler, started, preempted, step = Scheduler(config, bm), [], [], 0
    while step <= max(ARRIVALS) or scheduler.has_unfinished_requests():
        for rid, prompt_len, max_tokens, priority in ARRIVALS.get(step, []):
            params = SamplingParams(max_tokens=max_tokens)
            priority = priority if policy == "priority" else 0  # fcfs: all 0
            request = Request(rid, list(range(prompt_len)), params,
                              arrival=int(rid[1:]), priority=priority)
            scheduler.add_request(request)
        out = scheduler.schedule()
        started += [s.request_id for s in out.scheduled if s.request_id not in started]
        preempted += [f"{rid} at step {step}" for rid in out.preempted]
        scheduler.update_from_output(out, {s.request_id: 7 for s in out.scheduled})
        step += 1
    return started, preempted


if __name__ == "__main__":
    print(f"{'policy':<10}{'started in order':<20}preempted")
    for policy in ("fcfs", "priority"):
        started, preempted = run(policy)
        print(f"{policy:<10}{' '.join(started):<20}{', '.join(preempted) or '-'}")
