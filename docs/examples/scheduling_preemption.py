"""Five requests, a cache of 8 blocks: the Scheduler preempts by recompute or swap."""

from reference import (BlockManager, Request, RequestStatus, SamplingParams, Scheduler,
                       SchedulerConfig)

# step -> the requests arriving then: (id, prompt length, max_tokens)
ARRIVALS = {0: [("r0", 6, 8), ("r1", 5, 8)], 1: [("r2", 7, 6)], 3: [("r3", 4, 6)],
            5: [("r4", 6, 5)]}
IDS = [rid for arriving in ARRIVALS.values() for rid, _, _ in arriving]
STATUS = {RequestStatus.SWAPPED: "S", RequestStatus.WAITING: "w"}


def cell(request: Request, num_new: int | None, preempted: bool) -> str:
    """One request's step: P<n> prefill chunk, D decode, X preempted, S swapped out,
    w waiting, blank before it arrives and after it finished."""
    if preempted:
        return "X"
    if num_new is None:
        return STATUS.get(request.status, "")
    # A decode computes the one token sampled in the step before.
    behind = request.num_tokens - request.num_computed_tokens
    return "D" if request.output_token_ids and behind == 1 else f"P{num_new}"


def run(mode: str) -> list[dict]:
    """Drive the scheduler as an engine would; one record per step."""
    bm = BlockManager(num_blocks=8, block_size=4, num_host_blocks=16,
                      enable_prefix_caching=False)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32,
                             enable_chunked_prefill=True, preemption_mode=mode)
    scheduler = Scheduler(config, bm)
    steps, step = [], 0
    while step <= max(ARRIVALS) or scheduler.has_unfinished_requests():
        for rid, prompt_len, max_tokens in ARRIVALS.get(step, []):
            params = SamplingParams(max_tokens=max_tokens)
            prompt = list(range(prompt_len))
            scheduler.add_request(Request(rid, prompt, params, arrival=IDS.index(rid)))
        waiting = [r.request_id for r in scheduler.waiting]
        out = scheduler.schedule()
        new = {s.request_id: s.num_new_tokens for s in out.scheduled}
        cells = {rid: cell(r, new.get(rid), rid in out.preempted)
                 for rid, r in scheduler.requests.items()}
        admitted = [rid for rid in new if rid in waiting]
        steps.append(dict(cells=cells, out=out, admitted=admitted,
                          free=bm.device.num_free_blocks,
                          swapped=[r.request_id for r in scheduler.swapped]))
        # Every request samples token 7 (not EOS): each runs to its max_tokens.
        scheduler.update_from_output(out, {rid: 7 for rid in new})
        step += 1
    return steps


if __name__ == "__main__":
    runs = {mode: run(mode) for mode in ("recompute", "swap")}
    row = "{:>4}  " + "{:>4}" * len(IDS) + "{:>6}"
    print(("      " + "".join(f"{m + ':':<28}" for m in runs)).rstrip())
    print(row.format("step", *IDS, "free") + "  " + row.format("", *IDS, "free")[6:])
    for i in range(max(len(r) for r in runs.values())):
        halves = [[r[i]["cells"].get(rid, "") for rid in IDS] + [r[i]["free"]]
                  if i < len(r) else [""] * (len(IDS) + 1) for r in runs.values()]
        line = row.format(i, *halves[0]) + "  " + row.format("", *halves[1])[6:]
        print(line.rstrip())
    out = runs["swap"][5]["out"]
    print("swap mode, step 5, the SchedulerOutput:")
    for s in out.scheduled:
        print("  ", s)
    print(f"   preempted={out.preempted} swap_out={out.swap_out} swap_in={out.swap_in}")
    print("swap mode, step 8: swap_in", runs["swap"][8]["out"].swap_in)

    for steps in runs.values():
        admitted = [rid for record in steps for rid in record["admitted"]]
        # First admissions in arrival order, then the preempted ones back, r4 last.
        assert admitted[:4] == ["r0", "r1", "r2", "r3"] and admitted[-1] == "r4"
        assert admitted[4:] == sorted(admitted[4:])
        for record in steps:
            out = record["out"]
            if out.preempted:  # the latest arrival goes first; no admission that step
                assert not record["admitted"]
                assert all(IDS.index(p) > IDS.index(s.request_id)
                           for p in out.preempted for s in out.scheduled)
            if record["swapped"]:  # while a request is swapped out, none is admitted
                assert not record["admitted"]
    # Recompute: r2's 7 prompt tokens and the 3 it had generated, computed again.
    recomputed = [runs["recompute"][i]["cells"]["r2"] for i in (8, 9)]
    assert recomputed == ["P7", "P3"]
