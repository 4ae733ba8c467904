"""The token budget: a long prompt is split into chunks that ride along with decodes."""

from reference import BlockManager, Request, SamplingParams, Scheduler, SchedulerConfig


def run(chunked: bool) -> list[dict[str, int]]:
    """Two short requests decode; a 20-token prompt arrives at step 1."""
    budget = 8 if chunked else 32  # without chunking, a prompt must fit one step whole
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                             max_model_len=32, enable_chunked_prefill=chunked)
    scheduler = Scheduler(config, BlockManager(num_blocks=32, block_size=4))
    for i in range(2):
        params = SamplingParams(max_tokens=6)
        scheduler.add_request(Request(f"short{i}", [1, 2, 3], params, arrival=i))
    steps = []
    for step in range(6):
        if step == 1:
            params = SamplingParams(max_tokens=2)
            scheduler.add_request(Request("long", list(range(20)), params, arrival=2))
        out = scheduler.schedule()
        steps.append({s.request_id: s.num_new_tokens for s in out.scheduled})
        assert out.num_batched_tokens <= config.max_num_batched_tokens
        scheduler.update_from_output(out, {s.request_id: 7 for s in out.scheduled})
    return steps


for chunked in (True, False):
    print(f"enable_chunked_prefill={chunked}:")
    for step, tokens in enumerate(run(chunked)):
        print(f"  step {step}: {tokens} = {sum(tokens.values())} tokens")
assert [s["long"] for s in run(True) if "long" in s][:3] == [6, 6, 6]
assert [s.get("long") for s in run(False)][1] == 20
