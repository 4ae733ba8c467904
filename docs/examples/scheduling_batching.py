"""Request-level (static) against iteration-level batching, on one Scheduler."""

from reference import BlockManager, Request, SamplingParams, Scheduler, SchedulerConfig

OUTPUT_LENS = [3, 12, 5, 9, 2, 11, 4, 7]  # tokens each request generates (unknown)
BATCH = 4  # sequences that run together


def run(iteration_level: bool) -> list[list[str]]:
    """Serve every request; returns the ids of the requests that ran in each step."""
    config = SchedulerConfig(max_num_seqs=BATCH, max_num_batched_tokens=64,
                             max_model_len=32)
    scheduler = Scheduler(config, BlockManager(num_blocks=64, block_size=4))
    queue = [Request(f"r{i}", [1, 2, 3, 4], SamplingParams(max_tokens=n), arrival=i)
             for i, n in enumerate(OUTPUT_LENS)]
    steps = []
    while queue or scheduler.has_unfinished_requests():
        if iteration_level:  # all join the queue: a freed slot is refilled at once
            for request in queue:
                scheduler.add_request(request)
            queue = []
        elif not scheduler.has_unfinished_requests():  # next batch when all finished
            for request in queue[:BATCH]:
                scheduler.add_request(request)
            queue = queue[BATCH:]
        out = scheduler.schedule()
        steps.append([s.request_id for s in out.scheduled])
        scheduler.update_from_output(out, {s.request_id: 7 for s in out.scheduled})
    return steps


if __name__ == "__main__":
    for name, iteration_level in (("request-level", False), ("iteration-level", True)):
        steps = run(iteration_level)
        busy = sum(len(s) for s in steps)  # slot-steps that computed a token
        slots = BATCH * len(steps)
        print(f"{name:>15}: {len(steps):2} steps, {busy} of {slots} slot-steps busy "
              f"({busy / slots:.0%})")
        print(" " * 17 + "batch sizes: " + " ".join(str(len(s)) for s in steps))
    static, continuous = run(False), run(True)
    assert sum(map(len, static)) == sum(map(len, continuous)) == sum(OUTPUT_LENS)
    assert len(continuous) < len(static)
